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


def start_munge() -> None:
    if os.path.exists(MUNGE_SOCKET):
        return
    os.makedirs("/run/munge", exist_ok=True)
    for path in ("/run/munge", "/etc/munge", "/var/lib/munge", "/var/log/munge"):
        if os.path.exists(path):
            subprocess.run(["chown", "-R", "munge:munge", path], check=True)
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    for _ in range(50):
        if os.path.exists(MUNGE_SOCKET):
            return
        time.sleep(0.1)
    raise RuntimeError("munged did not start")


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
        for _ in range(60):
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            if "idle" in state:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the test cluster did not come up: {state!r}\n" + (d / "slurmctld.log").read_text()[-2000:])
        yield env, d
    finally:
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)


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
