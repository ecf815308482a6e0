"""The PyTorchJob trainer on the simulated cluster, with names a user's model_name makes.

Pods are local processes that the fake kubelet starts with the operator's PET_* variables;
the job runs the real fabric check (gloo) on two "nodes", so what the trainer returns was
printed by a real torchrun worker and streamed from the master pod.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes.sim_cluster import SimCluster
from kubellm.backends.base import JOB_NAME_MAX, TrainJob, dns_name
from kubellm.backends.kubernetes.pytorchjob import PyTorchJobTrainer
from kubellm.config import ConfigError, pipeline_config


@pytest.mark.parametrize(
    "model_name",
    [
        "kubellm-tiny",
        "m" * 45,  # the longest model_name: the job name is cut and ends in a hash
    ],
)
def test_two_node_job_with_a_users_model_name(tmp_path: Path, model_name: str) -> None:
    name = dns_name(model_name, "fabric", "3f0c2a1e-77b1-4c5e")
    assert len(name) <= JOB_NAME_MAX
    with SimCluster(tmp_path) as sim:
        job = TrainJob(
            name=name,
            train_args=["--iters", "2"],
            module="kubellm.train.fabric",
            nnodes=2,
            nproc_per_node=1,
            timeout_s=120.0,
            image="ghcr.io/kubellm/trainer:test",
        )
        result = PyTorchJobTrainer(sim.api_client(), poll_interval_s=1.0).run(job)
        assert result.name == name
        assert result.metrics["world_size"] == 2.0
        assert result.metrics["allreduce_busbw_gbps"] > 0
        for pod in (f"{name}-master-0", f"{name}-worker-0"):
            # the job succeeds with its master; the worker may take a moment longer to exit
            sim.wait_for(
                lambda pod=pod: (
                    (sim.fake.get_object("pods", pod) or {}).get("status", {}).get("phase")
                    == "Succeeded"
                ),
                timeout_s=30,
                what=f"{pod} Succeeded",
            )
            assert len(pod) <= 63
        assert sim.errors == [] and sim.fake.errors == [] and sim.fake.forbidden == []


def test_a_digit_first_model_name_stops_at_preflight() -> None:
    """The PyTorchJob webhook and KServe reject names that start with a digit; the run says
    so before anything is created, in one line naming the parameter."""
    with pytest.raises(ConfigError) as info:
        pipeline_config({"model_name": "7b-chat"})
    assert str(info.value).startswith("invalid model_name='7b-chat'")
    assert "\n" not in str(info.value)
    # a name made from other parts still comes out valid
    assert dns_name("7b-chat", "train").startswith("k-7b-chat")
