"""Sweeps: Hydra launchers that run a `-m` sweep's jobs, and the bookkeeping they share.

    cluster=local   -> local.LocalLauncher: each job a submitit LocalExecutor job on this
                       machine, with its own free GPUs
    cluster=lab     -> slurm.SlurmLauncher: a SLURM job array through submitit
    cluster=slurm_dev  (the same, on the CPU partition of the test cluster, scripts/slurm_up.sh)

Both are a sweep.SweepLauncher, which takes the steps they share once: skip jobs that already
completed with the same config (so re-running a sweep into its folder finishes only what is
left), write `jobs.json` into the sweep folder for `labrun status`, poll the jobs, and end with
one table of every job's own result. Each names its scheduler (core/scheduler: LocalScheduler,
SlurmScheduler), which `labrun status` asks about the jobs later.
"""

# The comment every SLURM job labrun submits carries: this prefix and the sweep folder, so that
# `labrun queue` finds a user's sweeps among the cluster's jobs.
SLURM_COMMENT_PREFIX = "labrun:"
