"""Large-model start-up: a skeleton on the `meta` device, sharded before it is real, then the
pretrained weights read once (by rank 0) and streamed to the other ranks.

The naive start-up (`from_pretrained` on every rank, then `.to(device)`, then `fully_shard`)
holds a full float32 copy per rank in host memory, reads the weights from the volume once
per rank, and puts the whole model on every GPU before sharding it: a 70B model can never
start and an 8B one barely. Here:

1. `meta_parameters()`: the model (and its LoRA adapters) is built with every parameter on
   the `meta` device: no storage, no initialisation cost. Buffers (rotary frequencies) stay
   real: they are computed in `__init__` and no checkpoint carries them.
2. the caller wraps it (`fully_shard` per layer: the parameters become sharded DTensors, still
   on `meta`; or nothing for DDP / one process);
3. `materialize(model, device)`: storage for this rank's part only (`to_empty`), with the
   values of the tensors that were already real (buffers, adapters) put back;
4. `load_pretrained(...)`: rank 0 reads the safetensors files tensor by tensor with plain
   file reads (no mmap, so the page cache is not charged to the process), in chunks of at
   most `chunk_bytes`, and each chunk goes out with
   `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`: every rank keeps
   its shard of each tensor, the full tensor lives on a rank only for the broadcast.

Host memory per node is then one shard per rank plus one chunk on rank 0, whatever the
number of ranks; the weights are read from the volume once.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kubellm.config import ConfigError

# safetensors dtype names -> torch dtypes (the format's spec).
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
CHUNK_BYTES = 256 * 2**20  # what rank 0 holds of the checkpoint at a time
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Every parameter registered inside is moved to `meta` at once (buffers stay real).

    Modules create a weight with `torch.empty` and register it before they initialise it, so
    the initialisation runs on `meta` (free) and the only real allocation is one transient
    empty tensor at a time.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            cls = type(param)
            module._parameters[name] = cls(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every `meta` parameter storage on `device` (this rank's shard under FSDP2),
    uninitialised; tensors that were already real (buffers, LoRA adapters) keep their values."""
    real: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = _local(t)
        if not local.is_meta:
            real[name] = local.detach().to("cpu", copy=True)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name in real:
                _local(t).copy_(real[name])


@dataclass
class _Entry:
    file: Path
    name: str
    dtype: torch.dtype
    shape: list[int]
    begin: int  # absolute byte offsets in the file
    end: int


@dataclass
class LoadReport:
    loaded: int = 0  # tensors
    bytes: int = 0
    unused: list[str] = field(default_factory=list)  # in the files, not in the model


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory (sharded or not)."""
    index = model_dir / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    if (model_dir / SINGLE).is_file():
        return [model_dir / SINGLE]
    others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
        p.name for p in model_dir.glob("*.pt")
    )
    hint = f" (found {', '.join(others)}: pickled weights are never loaded)" if others else ""
    raise ConfigError(f"invalid model_name_or_path={str(model_dir)!r}: no safetensors{hint}")


def _entries(path: Path) -> list[_Entry]:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    start = 8 + size
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ConfigError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        b, e = info["data_offsets"]
        out.append(_Entry(path, name, _DTYPES[info["dtype"]], info["shape"], start + b, start + e))
    return out


def _read(f: Any, entry: _Entry) -> torch.Tensor:
    t = torch.empty(entry.shape, dtype=entry.dtype)
    raw = t.reshape(-1).view(torch.uint8).numpy()
    if raw.nbytes != entry.end - entry.begin:
        raise ConfigError(f"{entry.file.name}: tensor {entry.name} has a corrupt size")
    f.seek(entry.begin)
    if f.readinto(raw.data) != raw.nbytes:
        raise ConfigError(f"{entry.file.name}: truncated at tensor {entry.name}")
    return t


def _chunks(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Entries in file order, grouped up to `limit` bytes (a larger tensor goes alone)."""
    out: list[list[_Entry]] = []
    size = 0
    for e in sorted(entries, key=lambda e: (str(e.file), e.begin)):
        n = e.end - e.begin
        if not out or size + n > limit:
            out.append([])
            size = 0
        out[-1].append(e)
        size += n
    return out


def canonical(name: str) -> str:
    """A model state-dict key as the base model's checkpoint names it (PEFT's prefix and
    `base_layer` taken out)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def load_pretrained(
    model: nn.Module, model_dir: Path, *, rank: int, chunk_bytes: int | None = None
) -> LoadReport:
    """Fill `model`'s pretrained parameters from `model_dir` (collective when the process
    group exists: rank 0 reads, every rank keeps its part). Parameters the files lack must
    be ones the caller initialised itself (LoRA adapters; a tied lm_head); any other missing
    one is a ConfigError naming it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    distributed = dist.is_initialized()
    keys = {canonical(k): k for k in model.state_dict()}
    report = LoadReport()
    plan: list[list[_Entry]] = []
    error = ""
    if rank == 0:
        try:
            entries = [e for f in weight_files(model_dir) for e in _entries(f)]
        except (ConfigError, OSError, ValueError, KeyError) as err:
            error = str(err) if isinstance(err, ConfigError) else f"{model_dir}: {err}"
            entries = []
        report.unused = sorted(e.name for e in entries if e.name not in keys)
        plan = _chunks([e for e in entries if e.name in keys], chunk_bytes or CHUNK_BYTES)
        got = {e.name for chunk in plan for e in chunk}
        missing = [k for c, k in keys.items() if c not in got and not _own_init(model, k)]
        if missing and not error:
            error = (
                f"invalid model_name_or_path={str(model_dir)!r}: no weights for "
                f"{len(missing)} parameter(s), e.g. {missing[0]}"
            )
    header: list[Any] = [len(plan), error]
    if distributed:
        dist.broadcast_object_list(header, src=0)  # the other ranks need only the count
    if header[1]:
        raise ConfigError(header[1])
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    files: dict[Path, Any] = {}
    try:
        for i in range(header[0]):
            chunk: dict[str, Any] = {}
            for e in plan[i] if rank == 0 else []:
                f = files.get(e.file) or files.setdefault(e.file, e.file.open("rb"))
                chunk[keys[e.name]] = _read(f, e)
                report.loaded += 1
                report.bytes += e.end - e.begin
            if distributed:
                set_model_state_dict(model, chunk, options=options)
            else:
                _copy_into(model, chunk)
            del chunk
    finally:
        for f in files.values():
            f.close()
    return report


def _own_init(model: nn.Module, key: str) -> bool:
    """Parameters a pretrained checkpoint does not carry: LoRA adapters, and lm_head when it
    is the (tied) input embedding."""
    if ".lora_" in key:
        return True
    base = getattr(model, "get_base_model", lambda: model)()
    tied = getattr(getattr(base, "config", None), "tie_word_embeddings", False)
    return bool(tied) and canonical(key) == "lm_head.weight"


@torch.no_grad()
def _copy_into(model: nn.Module, chunk: dict[str, Any]) -> None:
    """One process: copy each full tensor into the parameter or buffer of that name."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    params.update(model.named_buffers())
    for k, v in chunk.items():
        params[k].copy_(v)


def init_adapters(model: nn.Module, seed: int) -> int:
    """Real, seeded initial values for LoRA adapters built on `meta` (identical on every
    rank, made before sharding); returns how many adapter layers were initialised."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return 0
    torch.manual_seed(seed)
    n = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in module.active_adapters:
            for holder in (module.lora_A, module.lora_B):
                if adapter in holder:
                    holder[adapter].to_empty(device="cpu")
            module.reset_lora_parameters(adapter, True)
            n += 1
    return n


# hub name -> its downloaded snapshot, once per process (`resolve`)
_DOWNLOADED: dict[str, Path] = {}


def resolve(name_or_path: str) -> Path:
    """A local directory as is; a hub name downloaded (safetensors and JSON files only).

    A hub name is downloaded once per process: the trainer resolves it before the process
    group exists (a download takes as long as it takes, with no collective waiting on it),
    and the later call that loads the weights gets the same snapshot at once.
    """
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if name_or_path in _DOWNLOADED:
        return _DOWNLOADED[name_or_path]
    from huggingface_hub import snapshot_download

    try:
        got = Path(snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"]))
    except Exception as err:  # offline, unknown repo, auth: one line naming the model
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"invalid model_name_or_path={name_or_path!r}: {reason}") from None
    _DOWNLOADED[name_or_path] = got
    return got
