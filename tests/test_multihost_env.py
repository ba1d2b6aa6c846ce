"""Multi-process launch through the cluster environment alone (no coordinator flags).

Real subprocesses run ``python -m gemjax.parallel.multihost`` (join the job as
experiments/train.py does, print the layout, all-gather every process index) with
the variables ``srun`` sets. The expected coordinator is derived here from the
SLURM job id the way JAX documents it, and each process must see the other one
through a cross-process all-gather: a process that trained alone would report
process_count 1 and an all-gather of [its own index].
"""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "GEMJAX_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS",
                    "KUBERNETES_SERVICE_HOST", "MEGASCALE_", "TPU_")
SLURM_PORT_BASE = 65535 - 2 ** 12 + 1      # JAX: port = job id % 4096 + this


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _start(env):
    return subprocess.Popen([sys.executable, "-m", "gemjax.parallel.multihost", "--cpu_devices=2"], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def _layout(rc, out, err):
    assert rc == 0, f"exit {rc}:\n{out[-2000:]}\n{err[-3000:]}"
    [line] = [ln for ln in out.splitlines() if ln.startswith("LAYOUT ")]
    return json.loads(line[len("LAYOUT "):])


def _free_slurm_job_id():
    """A job id whose JAX coordinator port (in 61440..65535) is free right now."""
    for k in range(2 ** 12):
        port = SLURM_PORT_BASE + (os.getpid() + 97 * k) % 2 ** 12
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
        return 7 * 2 ** 12 + (port - SLURM_PORT_BASE), port
    raise RuntimeError("no free port in JAX's SLURM range")


def _slurm(job_id, ntasks, procid):
    return dict(SLURM_JOB_ID=str(job_id), SLURM_NTASKS=str(ntasks), SLURM_PROCID=str(procid),
                SLURM_LOCALID=str(procid), SLURM_STEP_NODELIST="localhost", SLURM_NODELIST="localhost",
                SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1")


def test_slurm_environment_joins_two_processes_and_plain_runs_stay_single():
    job_id, port = _free_slurm_job_id()
    pair = [_start(_env(**_slurm(job_id, 2, i))) for i in range(2)]
    plain = _start(_env())                                     # no cluster: alone
    one_task = _start(_env(**_slurm(job_id + 1, 1, 0)))        # 1-task SLURM job: alone, all devices
    partial = _start(_env(GEMJAX_NUM_PROCESSES="2"))           # a count, nothing else, no cluster
    layouts = [_layout(*_finish(p)) for p in pair]
    assert sorted(lay["process_index"] for lay in layouts) == [0, 1]
    for lay in layouts:
        assert lay["via"] == "slurm" and lay["coordinator"] == f"localhost:{port}"
        assert lay["process_count"] == 2 and lay["local_devices"] == 2
        assert lay["global_devices"] == 2 * lay["local_devices"]
        assert lay["allgather"] == [0, 1]                      # one job: each saw the other
    for lay in (_layout(*_finish(plain)), _layout(*_finish(one_task))):
        assert lay["via"] == "single" and lay["process_count"] == 1 and lay["allgather"] == [0]
        assert lay["global_devices"] == lay["local_devices"] == 2
    rc, out, err = _finish(partial)
    assert rc != 0 and "coordinator, process_id missing" in err and "--coordinator" in err, err[-2000:]


def test_train_cli_names_the_missing_flags():
    r = subprocess.run([sys.executable, "-m", "experiments.train", "--config=tiny",
                        "--num_processes=2", "--process_id=1"], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "coordinator missing" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
