"""``python -m pretrain.torchrun [torchrun options] -m pretrain.train [overrides]``: torchrun, with
the run's preemption status kept.

torchrun (``torch.distributed.run``, 2.13) ends with status 1 whenever a rank fails: a rank that
exits non-zero makes its elastic agent stop the other ranks (SIGTERM to each rank's process group,
SIGKILL after ``--shutdown-timeout``, 30 s) and raise ``ChildFailedError``, which ``@record``
reports and re-raises; the ranks' own exit codes appear only in that report. A SIGTERM (SIGINT,
SIGHUP, SIGQUIT: ``--signals-to-handle``) to torchrun itself is passed to the ranks the same way,
SIGKILL 30 s later, and re-raised (status 1); SIGUSR1 is not handled by default and kills
torchrun, while the ranks, in sessions of their own, never see it. So a run that stops for
preemption -- every rank saves, then exits with ``PREEMPTED_EXIT`` (75), which a Slurm script
answers with ``scontrol requeue`` -- would end with 1, or be killed mid-save.

This is torchrun with two differences:

- SIGTERM and SIGUSR1 to it are passed to each rank and torchrun goes on waiting: the ranks save
  and exit on their own time (bounded by the job's own kill: Slurm's ``KillWait`` after SIGTERM,
  the ``--signal`` grace for USR1), not the agent's 30 s;
- when a rank exited with 75 and every other failed rank did too or was stopped by the agent after
  it (SIGTERM, SIGKILL), it exits with 75 after one line saying so; any other failure is
  torchrun's report and status 1.

Options are torchrun's (``--max-restarts`` > 0 would restart a preempted run in place, not
end it). ``slurm/pretrain.sh`` needs none of this: it starts one srun task per rank.
"""

from __future__ import annotations

import os
import signal
import sys

FORWARDED = ("SIGTERM", "SIGUSR1")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's ranks), from ``/proc``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(entry))
    return out


def _forward(signum, frame) -> None:
    for pid in children(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


#: how the agent ends the ranks still running once one has exited: its stop signal, then SIGKILL
STOPPED_BY_AGENT = {-signal.SIGTERM, -signal.SIGKILL}


def exit_status(failures: dict) -> int:
    """75 when some rank exited with it and every other failed rank (``ChildFailedError.failures``:
    rank -> ProcessFailure) did too or was stopped by the agent after it, else torchrun's 1.
    torchrun records the ranks it stops as failures too: in a preemption the ranks agree on a
    step and save it together, and the first to exit gets the others, still exiting or (before
    training) waiting for a peer in the process group's start, SIGTERMed (and SIGKILLed 30 s
    later)."""
    from pretrain.reliability.faults import PREEMPTED_EXIT

    codes = {f.exitcode for f in failures.values()}
    return PREEMPTED_EXIT if PREEMPTED_EXIT in codes and codes <= {PREEMPTED_EXIT, *STOPPED_BY_AGENT} else 1


def main(argv: list[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    args = torchrun.parse_args(argv)
    # the agent installs its handlers after ours: it must leave these two to us
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",")
                                      if s.strip() and s.strip() not in FORWARDED)
    for name in FORWARDED:
        signal.signal(getattr(signal, name), _forward)
    try:
        record(torchrun.run)(args)
    except ChildFailedError as e:
        status = exit_status(e.failures)
        if status == 1:
            print(e.format_msg(), file=sys.stderr, flush=True)
        else:
            saved = sorted(r for r, f in e.failures.items() if f.exitcode == status)
            print(f"pretrain.torchrun: rank{'s' if len(saved) > 1 else ''} {', '.join(map(str, saved))} "
                  f"stopped for preemption; exit {status}", file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
