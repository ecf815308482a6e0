"""Slurm: training jobs as sbatch scripts (script.py) sent and waited for by the step on a
login node (trainer.py); `platform=slurm` selects it (kubellm.backends.select)."""
