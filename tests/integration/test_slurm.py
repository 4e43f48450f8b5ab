"""A real single-node Slurm cluster on this machine (Debian's slurm-wlm and munge, installed by
scripts/install_slurm.sh, which .ci/run calls): the single-node batch script trains Chimera on the
CPU, and a run outlives its jobs: a preempted job is requeued and resumes exactly, a job saves before
its time limit, a chain of jobs finishes the run and its last job finds nothing left to do."""
import os
import re
import shutil
import socket
import subprocess
import time

import pytest

from megatron.chimera.distributed.ports import free_port
from megatron.chimera.testing.launch import ROOT

MUNGE_SOCKET = "/run/munge/munge.socket.2"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged")),
    reason="Slurm is not installed (scripts/install_slurm.sh needs root and apt-get)")]



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
                raise RuntimeError(f"the test cluster did not come up: {state!r}\n"
                                   + (d / "slurmctld.log").read_text()[-2000:])
            time.sleep(0.5)
            state = slurm(["sinfo", "-h", "-o", "%T"], env)
        yield env, d
    finally:
        slurm(["scontrol", "shutdown"], env)
        for pidfile in (d / "slurmd.pid", d / "slurmctld.pid"):  # when the shutdown request got nowhere
            if pidfile.exists():
                subprocess.run(["kill", pidfile.read_text().strip()], capture_output=True)


LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|")
ITERS = 40  # a requeue lands a few iterations after iteration 3; the chain stops at 20


def job_settings(corpus, save, **more) -> str:
    """The batch script's --export: a 4-layer Chimera D=2 on the shipped corpus, 2 ranks on the CPU."""
    data, tokenizer = corpus[corpus.index("--data-path") + 1], corpus[corpus.index("--tokenizer-model") + 1]
    settings = {"PP": "2", "SCHEDULE": "chimera", "NUM_LAYERS": "4", "HIDDEN": "32", "HEADS": "4", "SEQ": "32",
                "MICRO_BATCH": "1", "GLOBAL_BATCH": "4", "TRAIN_ITERS": str(ITERS), "LR": "3e-3",
                "DATA_PATH": data, "TOKENIZER_MODEL": tokenizer, "SAVE": str(save), "MASTER_PORT": str(free_port()),
                **more}
    return "--export=ALL," + ",".join(f"{k}={v}" for k, v in settings.items())


def submit(env, *options: str, script="recipes/slurm/pretrain_gpt_single_node.sbatch") -> str:
    proc = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--ntasks-per-node=2", *options, script],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_until_gone(env, job: str, timeout: float = 300, release: bool = False) -> str:
    """Wait for the job to leave the queue and return its final state. release: start a requeued job
    at once instead of after Slurm's two-minute hold (its pending reason is BeginTime)."""
    deadline = time.monotonic() + timeout
    while (queued := slurm(["squeue", "-h", "-j", job, "-o", "%T %r"], env).strip()):
        assert time.monotonic() < deadline, f"job {job} still queued: {queued}"
        if release and queued == "PENDING BeginTime":
            slurm(["scontrol", "update", f"jobid={job}", "starttime=now"], env)
        time.sleep(0.5)
    return re.search(r"JobState=(\S+)", slurm(["scontrol", "show", "job", job], env)).group(1)


def losses(log: str) -> dict:
    return dict(LOSS.findall(log))


@pytest.fixture(scope="module")
def uninterrupted(cluster, corpus, tmp_path_factory):
    """One job that trains the whole run: the reference the interrupted runs must repeat."""
    env, _ = cluster
    d = tmp_path_factory.mktemp("uninterrupted")
    job = submit(env, f"--output={d}/job.out", job_settings(corpus, d / "ckpt", EVAL_ITERS="2"))
    assert wait_until_gone(env, job) == "COMPLETED", (d / "job.out").read_text()[-5000:]
    return (d / "job.out").read_text(), d / "ckpt"


def test_single_node_batch_script_trains_chimera(uninterrupted):
    log, save = uninterrupted
    assert f"(restart 0): resuming from iteration 0 of {ITERS}" in log
    assert "(--load = --save): starting from scratch" in log
    got = [float(x) for x in losses(log).values()]
    assert len(got) == ITERS and got[-1] < got[0]
    assert f"validation loss at iteration {ITERS}" in log
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)


def test_a_preempted_job_is_requeued_and_resumes_exactly(cluster, corpus, uninterrupted, tmp_path):
    """scontrol requeue is what preemption in REQUEUE mode does: SIGTERM, then requeue. The ranks save
    at the next iteration; the job starts again in the same output file and resumes from that save."""
    env, _ = cluster
    out = tmp_path / "job.out"
    job = submit(env, f"--output={out}", job_settings(corpus, tmp_path / "ckpt", EVAL_ITERS="2"))
    deadline = time.monotonic() + 120
    while not re.search(r"iteration\s+3/", out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and slurm(["squeue", "-h", "-j", job], env), "the job never trained"
        time.sleep(0.2)
    slurm(["scontrol", "requeue", job], env)
    assert wait_until_gone(env, job, release=True) == "COMPLETED"
    log = out.read_text()
    first, second = re.split(rf"job {job} \(restart 1\): resuming from iteration \d+ of {ITERS} in \S+\n", log)
    stopped = int(re.search(r"exiting on SIGTERM at iteration (\d+) after saving it", first).group(1))
    assert 3 <= stopped < ITERS and f"(restart 1): resuming from iteration {stopped} of" in log
    assert f"loaded checkpoint from {tmp_path / 'ckpt'} at iteration {stopped}" in second
    want = losses(uninterrupted[0])
    assert losses(first) == {k: v for k, v in want.items() if int(k) <= stopped}
    assert losses(second) == {k: v for k, v in want.items() if int(k) > stopped}


def test_a_job_saves_before_its_time_limit(cluster, corpus, tmp_path):
    """Slurm's time-limit check runs every 30 s, so the warning signal lands up to 30 s before it is due: 50 s
    before a 2-minute limit lands 40-70 s into the job, after the ranks installed their handler even on a
    loaded machine (at 20-50 s a rank still importing was once ended by it), and leaves them 50 s to save."""
    env, _ = cluster
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    job = submit(env, "--time=2", "--signal=TERM@50", f"--output={out}",
                 job_settings(corpus, save, TRAIN_ITERS="1000000", LOG_INTERVAL="100", EVAL_ITERS="0"))
    assert wait_until_gone(env, job, timeout=200) == "COMPLETED", out.read_text()[-3000:]
    stopped = re.search(r"exiting on SIGTERM at iteration (\d+) after saving it", out.read_text()).group(1)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == stopped


def test_a_chain_of_jobs_finishes_the_run_and_its_last_job_has_nothing_to_do(cluster, corpus, uninterrupted,
                                                                            tmp_path):
    """submit_schedules.sh --chain 3: the first job stops halfway (--exit-interval stands in for its
    time limit), the second resumes there and finishes, the third exits at once."""
    env, _ = cluster
    save = tmp_path / "ckpt"
    half = ITERS // 2
    proc = subprocess.run(
        ["recipes/slurm/submit_schedules.sh", "--chain", "3", "single_node", "--gpus-per-node=0",
         "--ntasks-per-node=2", f"--output={tmp_path}/%j.out",
         job_settings(corpus, save, EVAL_ITERS="2", EXTRA_ARGS=f"--exit-interval {half}")],
        cwd=ROOT, env={**env, "SCHEDULES": "chimera"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    jobs = re.findall(r"gpt-chimera: job (\d+)", proc.stdout)
    assert len(jobs) == 3
    assert [wait_until_gone(env, job) for job in jobs] == ["COMPLETED"] * 3
    logs = [(tmp_path / f"{job}.out").read_text() for job in jobs]
    assert f"exiting on --exit-interval {half} at iteration {half} after saving it" in logs[0]
    assert f"resuming from iteration {half} of {ITERS}" in logs[1]
    want = losses(uninterrupted[0])
    assert {**losses(logs[0]), **losses(logs[1])} == want and min(map(int, losses(logs[1]))) == half + 1
    assert logs[2].strip() == (f"job {jobs[2]}: training already complete (iteration {ITERS} of {ITERS} in {save}):"
                               " nothing to do")
