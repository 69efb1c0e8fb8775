"""A private one-node SLURM cluster for the tests: munged, MariaDB, slurmdbd, slurmctld and slurmd
on localhost.

Everything lives in one temporary folder (munge key and socket, the accounting database,
slurm.conf, slurmdbd.conf, gres.conf, state, spool, logs); the ports are free ones picked at start,
so the cluster clashes with no other SLURM on the machine. The daemons run in the foreground as
children of the test process; `stop()` cancels what is still queued and ends them. Debian's
slurm-wlm, slurmdbd, MariaDB and munge packages are installed when missing (`make slurm-deps` does
it up front; CI runs as root).

Accounting is real: slurmdbd stores every job in a private MariaDB (grant checks off: it listens on
127.0.0.1 only and lives as long as the test session), so `sacct` answers as on a production
cluster. The node declares GPUS counted GPUs (gres without device files: SLURM allocates and
accounts them, `gres/gpu` in a job's AllocTRES, but no device exists): a job may ask
`--gpus-per-node` and runs on the CPU.

    with Cluster() as c:
        job = c.sbatch("--wrap", "hostname")
        c.wait([job])
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "slurmdbd", "mariadb-server", "munge"]
DAEMONS = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sacct", "slurmdbd"]
DAEMONS += ["mariadbd", "mariadb-install-db"]
GPUS = 4  # counted GPUs on the node (no devices): jobs may ask for them, sacct accounts them


def ensure_packages() -> None:
    if all(shutil.which(d) for d in DAEMONS):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError(
            "SLURM is not installed: run `make slurm-deps` (as root, apt-get) or "
            f"install {' '.join(PACKAGES)}"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
        check=True,
        env=env,
        capture_output=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


class Cluster:
    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="mlmclm-slurm-"))
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # ------------------------------------------------------------------------- lifecycle
    def start(self) -> Cluster:
        ensure_packages()
        r = self.root
        for d in ("munge", "state", "spool", "log", "db"):
            (r / d).mkdir(mode=0o700)
        key, sock = r / "munge" / "munge.key", r / "munge" / "socket"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={r / 'munge' / 'pid'}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'seed'}",
            ],
            "munged",
        )
        self._await(sock.exists, "munged did not create its socket")
        self.db_port, self.dbd_port = free_port(), free_port()
        self.conf.write_text(self.slurm_conf(sock))
        self._start_accounting(sock)
        self._write_gres_conf()
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", self.node], "slurmd")
        self._await(
            lambda: self.run(["sinfo", "-h", "-o", "%T"], check=False).stdout.strip() == "idle",
            "the node did not come up idle",
        )
        return self

    def _start_accounting(self, munge_socket: Path) -> None:
        """MariaDB on a fresh database folder, then slurmdbd on it (slurmdbd.conf beside
        slurm.conf, where the daemons and sacct look for it); both listening on free ports."""
        r, db = self.root, self.root / "db"
        small = ["--innodb-log-file-size=4M", "--innodb-buffer-pool-size=16M"]
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={db}", "--user=root",
             "--auth-root-authentication-method=normal", "--skip-test-db", *small],
            check=True, capture_output=True,
        )  # fmt: skip
        self._spawn(
            ["mariadbd", "--no-defaults", f"--datadir={db}", f"--socket={r / 'db.sock'}",
             f"--port={self.db_port}", "--bind-address=127.0.0.1", "--user=root",
             f"--pid-file={r / 'db.pid'}", "--skip-grant-tables", *small],
            "mariadbd",
        )  # fmt: skip
        self._await(lambda: (r / "db.sock").exists(), "MariaDB did not start")
        dbd = r / "slurmdbd.conf"
        dbd.write_text(
            "\n".join(
                [
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={munge_socket}",
                    "DbdHost=localhost",
                    "DbdAddr=127.0.0.1",
                    f"DbdPort={self.dbd_port}",
                    "SlurmUser=root",
                    "StorageType=accounting_storage/mysql",
                    "StorageHost=127.0.0.1",
                    f"StoragePort={self.db_port}",
                    "StorageUser=root",
                    "StorageLoc=slurm_acct_db",
                    f"PidFile={r / 'slurmdbd.pid'}",
                    f"LogFile={r / 'log' / 'slurmdbd.log'}",
                ]
            )
            + "\n"
        )
        dbd.chmod(0o600)
        self._spawn(["slurmdbd", "-D"], "slurmdbd")
        self._await(
            lambda: self.run(["sacctmgr", "-n", "list", "cluster"], check=False).returncode == 0,
            "slurmdbd did not answer",
        )
        self.run(["sacctmgr", "-i", "add", "cluster", "mlmclmtest"])

    def _write_gres_conf(self) -> None:
        """The node's GPUS counted GPUs. SLURM drops a GPU without a character device: links to
        /dev/null stand in (no cgroups here restrict a job to its devices)."""
        dev = self.root / "dev"
        dev.mkdir()
        for i in range(GPUS):
            (dev / f"gpu{i}").symlink_to("/dev/null")
        (self.root / "gres.conf").write_text(
            f"NodeName={self.node} Name=gpu File={dev}/gpu[0-{GPUS - 1}]\n"
        )

    def slurm_conf(self, munge_socket: Path) -> str:
        r = self.root
        return (
            "\n".join(
                [
                    "ClusterName=mlmclmtest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={munge_socket}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    # No cgroups in a container: linuxproc tracks a step's processes by ancestry,
                    # so a signal to a step reaches torchrun's workers (they run in their own
                    # sessions).
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/builtin",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/slurmdbd",
                    "AccountingStorageHost=127.0.0.1",
                    f"AccountingStoragePort={self.dbd_port}",
                    f"AccountingStoragePass={munge_socket}",  # munge's socket, for slurmdbd
                    "AccountingStorageTRES=gres/gpu",
                    "GresTypes=gpu",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "MinJobAge=3600",  # finished jobs stay visible to `scontrol show job`
                    "KillWait=30",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} "
                    f"RealMemory={int(memory_mb() * 0.9)} Gres=gpu:{GPUS} State=UNKNOWN",
                    "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                ]
            )
            + "\n"
        )

    def stop(self) -> None:
        if self.procs and any(p.poll() is None for p in self.procs):
            self.run(["scancel", "--full", "--user", "root"], check=False)
            self._await(
                lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(), None, timeout=60
            )
        for p in reversed(self.procs):  # slurmd, slurmctld, slurmdbd, mariadbd, munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        for f in self.logs:
            f.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:  # a daemon that did start must not outlive the failure
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------ use
    def run(
        self, cmd: list[str], check: bool = True, env: dict | None = None, **kw
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            cmd,
            env={**self.env, **(env or {}), "SLURM_CONF": str(self.conf)},
            capture_output=True,
            text=True,
            **kw,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def sbatch(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> str:
        return self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout.strip()

    def jobs(self, job: str) -> list[dict[str, str]]:
        """`scontrol show job` records (one per array element) as field -> value."""
        out = self.run(["scontrol", "show", "job", "-o", job]).stdout
        return [
            dict(f.split("=", 1) for f in line.split() if "=" in f)
            for line in out.splitlines()
            if line.strip()
        ]

    def state(self, job: str) -> list[str]:
        return [j["JobState"] for j in self.jobs(job)]

    def wait(self, jobs: list[str], timeout: float = 300) -> None:
        """Until every job (and array element) has ended; raises on a timeout."""
        final = {
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
            "PREEMPTED",
        }
        self._await(
            lambda: all(s in final for j in jobs for s in self.state(j)),
            f"jobs {jobs} did not end in {timeout} s",
            timeout=timeout,
        )

    # --------------------------------------------------------------------------- helpers
    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self.logs.append(log)
        self.procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        )

    def _await(self, ready, message, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if ready():
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        if message is None:
            return
        raise RuntimeError(f"{message}\n{self.daemon_logs()}")

    def daemon_logs(self, chars: int = 2000) -> str:
        """The end of each daemon's log (slurmctld's and slurmd's say why a job ended as it did)."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-chars:]}"
            for p in sorted((self.root / "log").glob("*"))
            if p.is_file()
        )
