"""placeholder until the SLURM launcher lands"""
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher  # noqa: F401
