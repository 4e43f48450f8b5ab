"""A real single-node Slurm cluster on this machine (Debian's slurm-wlm and munge, installed by
scripts/install_slurm.sh, which .ci/run calls): submit the single-node batch script for a short
Chimera run on the CPU and check the job's output."""
import os
import re
import shutil
import socket
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUNGE_SOCKET = "/run/munge/munge.socket.2"

pytestmark = pytest.mark.skipif(
    not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged")),
    reason="Slurm is not installed (scripts/install_slurm.sh needs root and apt-get)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def munge_works() -> bool:
    return subprocess.run(["munge", "-n"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10).returncode == 0


def start_munge() -> None:
    """Start munged unless a live one answers. A socket file alone proves nothing: a munged that died
    (a rebooted or snapshotted machine) leaves it behind and every Slurm call then fails to authenticate."""
    if munge_works():
        return
    os.makedirs("/run/munge", exist_ok=True)
    for path in ("/run/munge", "/etc/munge", "/var/lib/munge", "/var/log/munge"):
        if os.path.exists(path):
            subprocess.run(["chown", "-R", "munge:munge", path], check=True)
    subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True, timeout=30)
    deadline = time.monotonic() + 10
    while not munge_works():
        if time.monotonic() > deadline:
            raise RuntimeError("munged did not start: `munge -n` still fails")
        time.sleep(0.2)


def slurm(command: list, env: dict) -> str:
    """stdout of a Slurm client command, or "" when it fails or stalls (an unreachable controller
    makes each call wait tens of seconds, which must not add up to an hour)."""
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=15).stdout
    except subprocess.TimeoutExpired:
        return ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    (d / "state").mkdir()
    (d / "spool").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    start_munge()
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env)
    subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env)
    try:
        deadline, state = time.monotonic() + 60, ""
        while "idle" not in state:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test cluster did not come up: {state!r}\n" + (d / "slurmctld.log").read_text()[-2000:])
            time.sleep(0.5)
            state = slurm(["sinfo", "-h", "-o", "%T"], env)
        yield env, d
    finally:
        slurm(["scontrol", "shutdown"], env)
        for pidfile in (d / "slurmd.pid", d / "slurmctld.pid"):  # when the shutdown request got nowhere
            if pidfile.exists():
                subprocess.run(["kill", pidfile.read_text().strip()], capture_output=True)


def test_single_node_batch_script_trains_chimera(cluster, corpus, tmp_path):
    env, d = cluster
    data, tokenizer = corpus[corpus.index("--data-path") + 1], corpus[corpus.index("--tokenizer-model") + 1]
    settings = {"NPROC_PER_NODE": "2", "PP": "2", "SCHEDULE": "chimera", "NUM_LAYERS": "4", "HIDDEN": "32",
                "HEADS": "4", "SEQ": "32", "MICRO_BATCH": "1", "GLOBAL_BATCH": "4", "TRAIN_ITERS": "6",
                "LR": "3e-3", "DATA_PATH": data, "TOKENIZER_MODEL": tokenizer, "SAVE": str(tmp_path / "ckpt"),
                "MASTER_PORT": str(free_port())}
    out = tmp_path / "job.out"
    proc = subprocess.run(
        ["sbatch", "--wait", "--gpus-per-node=0", f"--output={out}",
         "--export=ALL," + ",".join(f"{k}={v}" for k, v in settings.items()),
         "scripts/slurm/pretrain_gpt_single_node.sbatch"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-5000:]
    assert re.search(r"Submitted batch job \d+", proc.stdout)
    losses = [float(x) for x in re.findall(r"lm loss: (\S+) \|", log)]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "validation loss at iteration 6" in log
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "6"
