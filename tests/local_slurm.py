"""A SLURM cluster of two nodes on this host, for the tests: slurmctld and two slurmd on loopback.

No munge and no systemd: `AuthType=auth/none`, `CredType=cred/none`, every daemon run as root with its
files in one folder. Debian's slurm-wlm builds slurmd for several nodes per host (`slurmd -N NAME`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
NODES = ("n1", "n2")
CRED_EXPIRE = 5  # seconds; SLURM's least
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
}


def why_not_available() -> str | None:
    """None where a local cluster can run here; else the reason, for the skip message."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} not found): `make test` installs Debian's slurm-wlm "
            "where it runs as root with apt (or: apt-get install slurm-wlm)"
        )
    if os.geteuid() != 0:
        return "the local SLURM cluster runs its daemons as root, and these tests do not run as root"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    def __init__(self, folder: Path):
        self.folder = folder
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}

    def write_config(self) -> None:
        f = self.folder
        (f / "state").mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 State=UNKNOWN" for n in NODES)
        (f / "slurm.conf").write_text(
            f"""ClusterName=tests
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire={CRED_EXPIRE}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool-%n
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f}/slurmctld.log
SlurmdLogFile={f}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def start(self, timeout: float = 60) -> None:
        self.write_config()
        self.run("slurmctld", "-c")  # -c: a clean start, no state from an earlier cluster
        for node in NODES:
            self.run("slurmd", "-N", node)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
            if len(states) == len(NODES) and all(state == "idle" for state in states):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the local SLURM nodes did not come up: {states}; logs in {self.folder}")

    def stop(self) -> None:
        self.run("scontrol", "shutdown", check=False)  # slurmctld and every slurmd
        for pid_file in self.folder.glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), 15)
            except (ValueError, ProcessLookupError):
                pass

    def job_records(self, job: str) -> list[dict[str, str]] | None:
        """The controller's record of the job (one per task of an array): JobState, Restarts, ...; [] once the
        job has been purged, None when scontrol itself failed (a busy controller times out): not an answer."""
        result = self.run("scontrol", "show", "job", "-o", job, check=False)
        if result.returncode != 0:
            return [] if "Invalid job id" in result.stderr else None
        return [
            dict(f.split("=", 1) for f in line.split() if "=" in f)
            for line in result.stdout.splitlines()
            if line.strip()
        ]

    def job_state(self, job: str) -> str:
        """PENDING, RUNNING, ... of the job's first record; UNKNOWN when the controller did not answer."""
        records = self.job_records(job)
        return "UNKNOWN" if records is None else records[0]["JobState"] if records else ""

    def wait_until_finished(self, job: str, timeout: float) -> list[dict[str, str]]:
        """Until every record of the job is in a final state (COMPLETED, FAILED, ...); returns the records.
        A requeued job passes through REQUEUED, COMPLETING and PENDING, never a final state, so its restart
        is waited for (squeue's default listing can miss a job in between: seen on a loaded machine).
        SLURM holds a requeued job back until its previous launch's credential has expired (cred_expire + 1 s:
        120 s by default, 5 s in this cluster's config), and its scheduler may take a minute more to look
        again: once the credential has expired, a pending job is started at once, to keep the tests short.
        (Sooner, its launch fails: "Job credential revoked".)"""
        deadline, pending_since = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            records = self.job_records(job)
            if records is not None and all(r.get("JobState") in FINAL_STATES for r in records):
                return records
            for record in records or []:
                if record.get("JobState") != "PENDING":
                    pending_since.pop(record["JobId"], None)
                elif time.monotonic() - pending_since.setdefault(record["JobId"], time.monotonic()) > CRED_EXPIRE + 2:
                    self.run("scontrol", "update", f"JobId={record['JobId']}", "StartTime=now", check=False)
            time.sleep(1)
        raise TimeoutError(f"job {job} still {self.job_state(job)} after {timeout:.0f} s")
