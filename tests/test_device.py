"""Devices (--device cpu|cuda[:N]): a run trained on one device is audited on another.

Nothing a run writes depends on the device: the task is built on the CPU, checkpoints and hashes are
CPU bytes, and the device is named only in the informational hardware description. The CUDA tests at
the end run only where a GPU is visible.
"""

import hashlib
import json
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import cli
from veritrain import hardware, randomness, store
from veritrain.cli import main
from veritrain.engine import EngineConfig, UnsupportedOpError, step_context
from veritrain.runner import TrainOptions, _resume_state, audit, place_task, to_device, train, unverified_fields
from veritrain.task import Task, current_device, using_device

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
TRAIN = ["digits-cnn", "--steps", "2", "--checkpoint-every", "1", "--quiet", "--set", "batch_size=16"]


def files(run) -> dict:
    """name -> bytes of every file of a run."""
    out = {}
    for d, _, names in os.walk(run):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, run)] = open(p, "rb").read()
    return out


def committed(m: dict) -> dict:
    """What the root commits to in a manifest (store.run_description), and the commitments themselves."""
    return {"run": store.run_description(m), "root": m["root"], "leaves": m["leaves"], "checkpoints": m["checkpoints"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("device")
    cli("train", *TRAIN, "--out", d / "default", check=0)
    cli("train", *TRAIN, "--out", d / "cpu", "--device", "cpu", check=0)
    return d / "default", d / "cpu"


# --- (a) an explicit --device cpu is the default ------------------------------------------------


def test_explicit_cpu_writes_the_same_run_as_the_default(runs):
    default, cpu = runs
    a, b = files(default), files(cpu)
    assert sorted(a) == sorted(b)
    for name in a:
        if name != store.MANIFEST:  # the manifest also holds timings and a creation time
            assert a[name] == b[name], name
    ma, mb = store.load_manifest(str(default)), store.load_manifest(str(cpu))
    assert committed(ma) == committed(mb) and ma["root"]
    assert ma["hardware"]["device"] == mb["hardware"]["device"] == "cpu"


# --- (b) a device this machine cannot use: exit 2, nothing written --------------------------------


def unusable() -> list[tuple[str, str]]:
    """(device, what the error says) for devices this machine cannot use."""
    bad = [("bogus", "unknown device"), ("cuda:x", "unknown device"), ("cpu:1", "unknown device")]
    if CUDA:
        n = torch.cuda.device_count()
        return bad + [(f"cuda:{n}", "no such CUDA device")]
    return bad + [("cuda", "CUDA is not available"), ("cuda:0", "CUDA is not available")]


def test_an_unusable_device_exits_2_and_writes_nothing(runs, tmp_path):
    run = runs[0]
    before = files(run)
    gpu = "cuda" if not CUDA else f"cuda:{torch.cuda.device_count()}"  # 'bogus' and the rest: below, in-process
    p = cli("train", *TRAIN, "--out", tmp_path / "new", "--device", gpu)
    assert p.returncode == 2 and f"--device {gpu!r}" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "new").exists()
    p = cli("audit", run, "--out", tmp_path / "audit", "--device", gpu)
    assert p.returncode == 2 and "cuda" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "audit").exists() and files(run) == before


def test_every_command_checks_its_device_first(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hardware, "apply_process_settings", lambda: None)  # malloc and threads: not in pytest
    run = str(runs[0])
    out = str(tmp_path / "out")
    commands = [["train", "digits-cnn", "--out", out], ["train", "digits-cnn", "--out", run, "--resume"],
                ["audit", run, "--out", out], ["eval", run], ["calibrate", "digits-cnn", "--out", out],
                ["experiment", "storage", "--out", out], ["_replay", run, "--out", out],
                ["_compare", run, out, "--out", out], ["serve", run], ["dispute", run, out]]
    before = files(run)
    for device, why in unusable():
        for argv in commands:
            assert main([*argv, "--device", device]) == 2, (argv, device)
            err = capsys.readouterr().err
            assert f"--device {device!r}" in err and why in err, (argv, err)
    assert not os.path.exists(out) and files(run) == before


def test_parse_device_names_the_device_and_the_reason(monkeypatch):
    assert hardware.parse_device("cpu") == torch.device("cpu") == hardware.parse_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert hardware.parse_device("cuda") == torch.device("cuda", 0)
    assert hardware.parse_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(hardware.DeviceError, match=r"'cuda:2': no such CUDA device \(this machine has 2"):
        hardware.parse_device("cuda:2")
    with pytest.raises(hardware.DeviceError, match="'gpu': unknown device"):
        hardware.parse_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(hardware.DeviceError, match=r"'cuda:1': CUDA is not available"):
        hardware.parse_device("cuda:1")


# --- (c) run files are device-independent -----------------------------------------------------------


def test_run_files_name_no_device(runs):
    run = runs[0]
    for name, data in files(run).items():
        assert b"cuda" not in data and b"device" not in data or name == store.MANIFEST, name
        if name.endswith(".safetensors"):  # the header is JSON; the rest is raw tensor bytes
            n = int.from_bytes(data[:8], "little")
            assert b"cpu" not in data[8:8 + n], name
        elif not name.endswith(".vtlog") and name != store.MANIFEST:  # records (JSON)
            assert b"cpu" not in data, name
    m = store.load_manifest(str(run))
    text = json.dumps(store.run_description(m))
    assert "cpu" not in text and "cuda" not in text and "device" not in text
    # the device is named only where no commitment reaches: the hardware description
    assert "hardware" not in store.RUN_FIELDS and "hardware" in unverified_fields(m)
    other = json.loads(json.dumps(m))
    other["hardware"].update(device="cuda:0", device_name="some GPU")
    assert store.run_sha256(other) == store.run_sha256(m)


# --- (d) CUDA settings -----------------------------------------------------------------------------


@pytest.fixture
def cuda_flags():
    m = torch.backends.cuda.matmul
    names = [(m, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"), (m, "allow_fp16_reduced_precision_reduction"),
             (m, "allow_bf16_reduced_precision_reduction")]
    if hasattr(m, "allow_fp16_accumulation"):
        names.append((m, "allow_fp16_accumulation"))
    saved = [(o, n, getattr(o, n)) for o, n in names]
    yield names
    for o, n, v in saved:
        setattr(o, n, v)
    hardware.configure_device("cpu")


def test_configure_device_turns_off_tf32_and_reduced_precision(cuda_flags):
    for o, n in cuda_flags:
        setattr(o, n, True)
    assert hardware.configure_device("cpu") == {}  # nothing to set on a CPU
    assert all(getattr(o, n) for o, n in cuda_flags)
    applied = hardware.configure_device(torch.device("cuda", 0))
    assert not any(getattr(o, n) for o, n in cuda_flags)
    assert applied["cuda.matmul.allow_tf32"] is False and applied["cudnn.allow_tf32"] is False
    assert applied["cuda.matmul.allow_fp16_reduced_precision_reduction"] is False
    assert applied["cuda.matmul.allow_bf16_reduced_precision_reduction"] is False
    assert applied["cudnn_in_steps"] is False and applied["deterministic_algorithms"] is False


def test_describe_names_the_device_in_use():
    assert hardware.describe()["device"] == "cpu" == str(current_device())
    with using_device("meta"):
        assert current_device() == torch.device("meta")
    assert current_device() == torch.device("cpu")


# --- (e) placing a task on a device -----------------------------------------------------------------


def test_to_device_moves_every_tensor_of_a_nested_batch():
    t = torch.arange(6.0).reshape(2, 3)
    batch = {"x": t, "pair": (t.long(), [t, {"deep": t.bool()}]), "name": "digits", "n": 3, "none": None}
    moved = to_device(batch, "meta")
    assert moved["x"].is_meta and moved["pair"][0].is_meta and moved["pair"][1][0].is_meta
    assert moved["pair"][1][1]["deep"].is_meta and moved["pair"][1][1]["deep"].dtype == torch.bool
    assert moved["pair"][0].dtype == torch.int64 and moved["x"].shape == (2, 3)
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert (moved["name"], moved["n"], moved["none"]) == ("digits", 3, None)
    same = to_device(batch, "cpu")
    assert same["x"] is t  # already there: not copied


def tiny_task():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    return Task(model=model, optimizer=opt, batch=lambda step: {"x": x, "y": [y]},
                loss=lambda m, b: F.mse_loss(m(b["x"]), b["y"][0]))


def test_place_task_moves_model_optimizer_state_and_batches():
    task = tiny_task()
    task.run_step(task.batch(0))  # Adam's state exists now (it is created at the first step)
    params = list(task.model.parameters())
    place_task(task, "cpu")  # already there: nothing changes
    assert list(task.model.parameters()) == params and list(task.optimizer.state) == params
    place_task(task, "meta")
    params = list(task.model.parameters())  # new objects on meta (CUDA keeps them): the optimizer follows
    assert all(p.is_meta for p in params) and all(b.is_meta for b in task.model.buffers())
    assert [p for g in task.optimizer.param_groups for p in g["params"]] == params
    assert list(task.optimizer.state) == params
    for p in params:
        state = task.optimizer.state[p]
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
        assert state["step"].device.type == "cpu"  # where Adam keeps its step counter
    b = task.batch(1)
    assert b["x"].is_meta and b["y"][0].is_meta


def test_resume_places_the_checkpointed_optimizer_state(tmp_path):
    run = tmp_path / "run"
    opts = dict(task="digits-cnn", steps=2, checkpoint_every=1, progress=False, config={"batch_size": 16})
    full = train(TrainOptions(out=str(run), **opts))
    m = store.load_manifest(str(run))  # as if killed after the first step
    m.update(checkpoints=m["checkpoints"][:2], leaves=m["leaves"][:1], steps_completed=1, complete=False, root=None)
    store.save_manifest(str(run), m)
    for device in ["cpu"] + (["cuda"] if CUDA else []):
        _, task, start, _ = _resume_state(TrainOptions(out=str(run), resume=True, **opts), torch.device(device))
        assert start == 1
        assert all(p.device.type == device for p in task.model.parameters())
        states = [v for s in task.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert states and all(v.device.type == device for v in states)
    resumed = train(TrainOptions(out=str(run), resume=True, **opts))
    assert resumed["root"] == full["root"]


# --- ops without a kernel on the device -------------------------------------------------------------

_lib = torch.library.Library("veritrain_device_test", "DEF")
_lib.define("gpu_only(Tensor x) -> Tensor")
_lib.impl("gpu_only", lambda x: x * 2, "CUDA")
_lib.define("broken(Tensor x) -> Tensor")


def _broken(x):
    raise RuntimeError("a plain failure")


_lib.impl("broken", _broken, "CPU")


def test_an_op_without_a_kernel_on_the_device_is_named():
    x = torch.ones(3)
    if not CUDA:
        with pytest.raises(UnsupportedOpError, match=r"step 5: veritrain_device_test.gpu_only.default cannot run on "
                                                      r"cpu in float64: Could not run"):
            with step_context(EngineConfig(), 5):
                torch.ops.veritrain_device_test.gpu_only(x)
    with pytest.raises(RuntimeError, match="a plain failure") as e:  # other failures are left as they are
        with step_context(EngineConfig(), 5):
            torch.ops.veritrain_device_test.broken(x)
    assert not isinstance(e.value, UnsupportedOpError)


# --- the counter-based generator ------------------------------------------------------------------


def direct_draws(device) -> dict:
    s = lambda i: randomness.Stream(11, 3, i)  # noqa: E731
    out = {} if str(device) == "meta" else {  # multinomial reads its probabilities' values
        "multinomial": randomness.multinomial(s(7), torch.tensor([0.1, 0.2, 0.7]).to(device), 20, True)}
    return {**out,"uniform": randomness.uniform(s(0), (257,), device),
            "uniform24": randomness.uniform(s(1), (5, 7), device, bits=24),
            "normal": randomness.normal(s(2), (257,), device)[0],
            "normal_scale": randomness.normal(s(2), (257,), device)[1],
            "exponential": randomness.exponential(s(3), (64,), device, 1.5)[0],
            "bernoulli": randomness.bernoulli_mask(s(4), (300,), 0.3, device),
            "bernoulli_p": randomness.bernoulli_mask(s(5), (4, 5), torch.linspace(0, 1, 5), device),
            "randperm": randomness.randperm(s(6), 100, device)}


def engine_draws(device) -> dict:
    """Random ops of a step under the engine (every draw from the counter-based generator)."""
    with step_context(EngineConfig(seed=5), 2):
        out = {"rand": torch.rand(257, device=device), "randn": torch.randn(257, device=device),
               "randint": torch.randint(0, 1000, (300,), device=device),
               "randperm": torch.randperm(100, device=device),
               "bernoulli": torch.bernoulli(torch.full((300,), 0.3, device=device)),
               "dropout": F.dropout(torch.ones(300, device=device), 0.5, training=True),
               "normal_": torch.empty(64, device=device).normal_(1.0, 2.0)}
    return out


def bits(t: torch.Tensor) -> bytes:
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).digest()


def test_random_draws_land_on_the_requested_device():
    meta = direct_draws("meta")
    assert len(meta) == 8 and all(t.is_meta for t in meta.values()), {k: t.device for k, t in meta.items()}
    a, b = direct_draws("cpu"), engine_draws("cpu")
    assert {k: bits(t) for k, t in a.items()} == {k: bits(t) for k, t in direct_draws(torch.device("cpu")).items()}
    assert {k: bits(t) for k, t in b.items()} == {k: bits(t) for k, t in engine_draws("cpu").items()}


# --- (f) CUDA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["auto", "1"])
def test_compiled_paths_run_on_the_cpu_only(monkeypatch, setting):
    """On an H200 the compiled paths trained digits-cnn to another state than the CPU (same log, failed
    audit) while the eager engine on CUDA gave the CPU's bits: on a GPU every op takes the eager engine,
    even with VERITRAIN_COMPILE=1."""
    from veritrain import blocked, capture, rounding
    from veritrain.fused import FusedKernels

    monkeypatch.setenv("VERITRAIN_COMPILE", setting)
    large = 1 << 24
    for enabled_for in (FusedKernels.enabled_for, capture.enabled_for, blocked.enabled_for):
        assert enabled_for(large, "cpu") and enabled_for(large, torch.device("cpu")), enabled_for.__module__
        for device in ("cuda", "cuda:1", torch.device("cuda", 0), "meta"):
            assert not enabled_for(large, device), (enabled_for.__module__, device)
    # the candidate scan asks the same rule about its tensor's device
    asked = []
    monkeypatch.setattr(rounding, "compiled_path", lambda n, device, *a: asked.append(device) or False)
    y = torch.randn(1 << 10, dtype=torch.float64)
    rounding._candidates(y, y.abs(), 2.0, rounding.Grid(32))
    assert asked == [y.device]



def test_the_engine_asks_for_compiled_paths_on_its_operands_device(monkeypatch):
    """Each compiled path is asked about the device of a tensor of the op (a CUDA op never about the CPU: on the
    H200 machine that made every CUDA process compile the compiler check on its CPU, for paths it never takes)."""
    from veritrain import engine as engine_module, fused

    asked = []
    real = fused.compiled_path
    monkeypatch.setattr(fused, "compiled_path", lambda n, device, *a: asked.append(device) or real(n, device, *a))
    monkeypatch.setattr(engine_module, "_FUSED_CACHE", {})
    g = torch.Generator().manual_seed(3)
    x, w = torch.rand(256, 300, generator=g) + 0.5, torch.rand(300, 4, generator=g)
    with step_context(EngineConfig(), 0):
        torch.exp(x).mm(w).sum()
    assert asked and all(isinstance(d, torch.device) and d == x.device for d in asked), asked


@needs_cuda
def test_a_cuda_step_never_runs_the_compiler_check(monkeypatch):
    from veritrain import engine as engine_module

    monkeypatch.setattr(hardware, "_compiler_ok", None)
    monkeypatch.setattr(engine_module, "_FUSED_CACHE", {})
    g = torch.Generator().manual_seed(3)
    x, w = (torch.rand(256, 300, generator=g) + 0.5).cuda(), torch.rand(300, 4, generator=g).cuda()
    with step_context(EngineConfig(), 0):
        torch.exp(x).mm(w).sum()
    assert hardware._compiler_ok is None


@needs_cuda
def test_counter_based_draws_are_the_same_bits_on_cpu_and_cuda():
    for draws in (direct_draws, engine_draws):
        cpu, gpu = draws("cpu"), draws("cuda")
        assert all(t.device.type == "cuda" for t in gpu.values())
        assert {k: bits(t) for k, t in cpu.items()} == {k: bits(t) for k, t in gpu.items()}, draws.__name__


@needs_cuda
@pytest.mark.parametrize("trainer,auditor", [("cuda", "cpu"), ("cpu", "cuda")])
def test_trained_on_one_device_audited_on_the_other(tmp_path, trainer, auditor):
    run = tmp_path / "run"
    cli("train", "digits-cnn", "--out", run, "--steps", "4", "--checkpoint-every", "2", "--quiet", "--device", trainer,
        check=0)
    m = store.load_manifest(str(run))
    assert m["hardware"]["device"].startswith(trainer)
    if trainer == "cuda":
        assert m["hardware"]["device_settings"]["cuda.matmul.allow_tf32"] is False
    p = cli("audit", run, "--json", "--quiet", "--device", auditor)
    r = json.loads(p.stdout)
    assert p.returncode == 0 and r["accepted"], r["reasons"]
    assert r["root"] == m["root"] and len(r["checkpoints"]) == 2 and all(c["match"] for c in r["checkpoints"])
    assert r["hardware"]["device"].startswith(auditor)


@needs_cuda
def test_a_cuda_run_writes_what_a_cpu_run_writes(tmp_path, runs):
    run = tmp_path / "gpu"
    cli("train", *TRAIN, "--out", run, "--device", "cuda", check=0)
    m, ref = store.load_manifest(str(run)), store.load_manifest(str(runs[0]))
    assert store.run_description(m) == store.run_description(ref)
    assert m["initial_state_sha256"] == ref["initial_state_sha256"]  # built on the CPU either way
    assert files(run)[store.ckpt_name(0)] == files(runs[0])[store.ckpt_name(0)]
    for name, data in files(run).items():
        assert b"cuda" not in data or name == store.MANIFEST, name
    r = audit(str(run), progress=False, device="cpu")
    assert r.accepted, r.reasons
