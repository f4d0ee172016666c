"""``autopar plan`` as a new user runs it: bad command lines, builders that return the wrong
things or raise, outputs that are not a loss, batches that do not split; one exit code
convention (0 planned, 2 input that cannot be planned, 1 internal error)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

import autopar
from autopar.cli.main import main
from examples import moe

GOOD = """
import torch
from torch import nn

def build(batch=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), (torch.randn(batch, 8),), loss


def loss(out):
    return out.pow(2).mean()


def build_3():
    return build(batch=3)
"""


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``autopar ARGV`` run in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def builder(tmp_path: Path, body: str, name: str = "model_file") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(GOOD + textwrap.dedent(body))
    return path


def test_a_good_builder_plans_with_exit_code_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", f"{builder(tmp_path, '')}:build", "--mesh", "dp=2", "--hardware", "cpu",
                          "--width", "200"], capsys)
    assert (code, err) == (0, "")
    assert "limit 21.60 GiB" in out  # 24 GiB less the cpu profile's 10% headroom
    code, out, _ = run(["plan", f"{builder(tmp_path, '')}:build", "--mesh", "dp=2", "--hardware", "cpu",
                        "--memory-headroom", "0.5", "--width", "200"], capsys)
    assert code == 0 and "limit 12.00 GiB" in out


@pytest.mark.parametrize("args,message", [
    (["--mesh", "dp=2,dp=4"], "axis 'dp' is named twice"),
    (["--mesh", "dp=0"], "sizes must be positive"),
    (["--mesh", "dp=two"], "bad mesh spec"),
    (["--mesh", "dp=2", "--memory-limit-gib", "-1"], "must be positive, got -1"),
    (["--mesh", "dp=2", "--memory-limit-gib", "0"], "must be positive, got 0"),
    (["--mesh", "dp=2", "--memory-headroom", "1.5"], r"must be a fraction in \[0, 1\)"),
    (["--mesh", "dp=2", "--memory-headroom", "0.1", "--memory-limit-gib", "4"], "not allowed with argument"),
    (["--mesh", "dp=2", "--devices-per-node", "0"], "must be positive"),
    (["--mesh", "dp=2", "--data-axes", "dp,dp"], "each axis once"),
    (["--mesh", "dp=2", "--expert-axes", ""], "each axis once"),
], ids=["duplicate-axis", "zero-axis", "bad-size", "negative-limit", "zero-limit", "headroom-above-1",
        "limit-and-headroom", "zero-devices-per-node", "data-axis-twice", "no-expert-axis"])
def test_bad_command_lines_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                  message: str) -> None:
    code, out, err = run(["plan", f"{builder(tmp_path, '')}:build", *args], capsys)
    assert code == 2 and out == ""
    assert re.search(message, err), err


@pytest.mark.parametrize("body,function,message", [
    ("def f():\n    return ('model', (torch.randn(2, 8),))\n", "f",
     r"the model must be a torch.nn.Module, got 'model' \(str\)"),
    ("def f():\n    return nn.Linear(8, 8)\n", "f", r"must return \(model, example_inputs.*got Linear"),
    ("def f():\n    return nn.Linear(8, 8), (torch.randn(2, 8),), torch.zeros(2, 8)\n", "f",
     r"loss_fn must be callable .*got a torch.float32 tensor of shape \(2, 8\)"),
    ("def f():\n    return nn.Linear(8, 8), ('tokens',), loss\n", "f",
     r"example_inputs\[0\] is 'tokens' \(str\); inputs must be tensors"),
    ("def f():\n    return nn.Linear(8, 8), (torch.randn(2, 8),)\n", "f",
     r"returned a torch.bfloat16 tensor of shape \(2, 8\); pass loss_fn"),  # the bf16 compute copy planned
    ("", "nothing", "has no function 'nothing'"),
], ids=["model-is-a-string", "not-a-tuple", "targets-as-loss-fn", "string-input", "non-scalar-output",
        "no-function"])
def test_builders_returning_the_wrong_things_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       body: str, function: str, message: str) -> None:
    code, out, err = run(["plan", f"{builder(tmp_path, body)}:{function}", "--mesh", "dp=2"], capsys)
    assert code == 2 and out == ""
    assert re.search(message, err), err
    assert "FakeTensor" not in err and "Traceback" not in err


def test_missing_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", "no/such/file.py:build", "--mesh", "dp=2"], capsys)
    assert code == 2 and "no such file no/such/file.py" in err


@pytest.mark.parametrize("where", ["builder", "import"])
def test_an_exception_in_user_code_keeps_its_location(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      where: str) -> None:
    body = ("def helper():\n    raise KeyError('no such layer')\n\n"
            + ("def f():\n    return helper()\n" if where == "builder" else "helper()\n"))
    path = builder(tmp_path, body)
    line = GOOD.count("\n") + 2  # the raise, 1-based, after GOOD's lines
    code, out, err = run(["plan", f"{path}:{'f' if where == 'builder' else 'build'}", "--mesh", "dp=2"], capsys)
    assert code == 2 and out == ""
    assert "raised KeyError: 'no such layer'" in err
    assert f'File "{path}", line {line}, in helper' in err, err
    if where == "builder":  # the builder's own frame, which called the helper, is shown too
        assert f'File "{path}", line {line + 3}, in f' in err, err
    assert "autopar/cli" not in err  # the user's frames only


def test_an_error_raised_by_the_builder_itself_keeps_its_location(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A torch error raised in the builder's own body (no Python frame below it) still
    names the builder's line."""
    path = builder(tmp_path, "def f():\n    return torch.randn(2) @ torch.randn(3)\n")
    code, out, err = run(["plan", f"{path}:f", "--mesh", "dp=2"], capsys)
    assert code == 2 and out == ""
    assert f'File "{path}", line {GOOD.count(chr(10)) + 2}, in f' in err, err


def test_a_batch_that_does_not_split_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "plan.json"
    code, out, err = run(["plan", f"{builder(tmp_path, '')}:build_3", "--mesh", "dp=2", "--hardware", "cpu",
                          "--json", str(out_json), "--width", "250"], capsys)
    assert code == 0, err
    note = "input 0 (shape [3, 8]): batch dim 0 cannot be split on dp=2 (3 does not divide by 2); placed R over dp"
    assert note in out
    assert json.loads(out_json.read_text())["notes"] == [note]


def test_plans_of_batches_that_split_have_no_notes() -> None:
    import torch

    model = torch.nn.Linear(8, 8)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, "cpu")
    assert autopar.plan(model, mesh, (torch.randn(4, 8),), loss_fn=lambda o: o.sum()).notes == []
    notes = autopar.plan(model, mesh, (torch.randn(6, 8),), loss_fn=lambda o: o.sum(), data_axes=("dp",)).notes
    assert notes == ["input 0 (shape [6, 8]): batch dim 0 cannot be split on tp=2 (6 does not divide by 4: it "
                     "is split 2 ways on other axes); placed S(0)R over dp x tp"], notes


@pytest.mark.parametrize("error,code", [
    (KeyError("a bug in autopar"), 1),
    (ValueError("a bug in autopar"), 1),
    (TypeError("a bug in autopar"), 1),
    (autopar.InputError("pins that cannot be met"), 2),
    (autopar.InputTypeError("an argument of the wrong type"), 2),
], ids=["KeyError", "ValueError", "TypeError", "InputError", "InputTypeError"])
def test_an_internal_error_is_not_reported_as_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        error: Exception, code: int) -> None:
    """Raised from inside autopar's planning: a ValueError or TypeError there is a bug like any
    other (exit 1, with its traceback), not input that cannot be planned (exit 2, one message)."""
    def broken(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr("autopar.search.problem.fold_repeated_blocks", broken)
    got, out, err = run(["plan", f"{builder(tmp_path, '')}:build", "--mesh", "dp=2", "--hardware", "cpu"], capsys)
    assert (got, out) == (code, "")
    if code == 1:
        assert "Traceback (most recent call last)" in err and 'autopar/search/problem.py", line' in err, err
        assert f"{type(error).__name__}: {error}" in err
        assert err.rstrip().endswith("autopar: internal error (a bug in autopar; please report it with the "
                                     "traceback above)")
    else:
        assert err == f"autopar: error: {error}\n"


def test_no_plan_within_the_memory_limit_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", f"{builder(tmp_path, '')}:build", "--mesh", "dp=2", "--hardware", "cpu",
                          "--memory-limit-gib", "1e-7"], capsys)
    assert (code, out) == (2, "")
    assert "no plan fits the memory limit" in err and "Traceback" not in err, err


def test_help_documents_the_exit_codes() -> None:
    from autopar.cli.main import parser

    text = parser().format_help()
    for line in ("0  the plan was found", "2  the input cannot be planned", "1  an internal error"):
        assert line in text
    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert "exit status" in page.lower() and "`2`" in page


def test_no_plan_within_the_solver_time_limit_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", f"{builder(tmp_path, '')}:build", "--mesh", "dp=2", "--hardware", "cpu",
                        "--solver-time-limit", "0.000001"], capsys)
    assert code == 2 and "no plan within its time limit" in err, err


def test_memory_pins_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--checkpoint, --checkpoint-blocks and --micro-batches reach the plan (a stack of 3
    repeated blocks: the first 2 checkpoint)."""
    body = """
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def stack():
        return Stack(), (torch.randn(4, 8),), loss
    """
    code, out, err = run(["plan", f"{builder(tmp_path, body)}:stack", "--mesh", "dp=2", "--hardware", "cpu",
                          "--checkpoint", "full", "--checkpoint-blocks", "2", "--micro-batches", "2",
                          "--width", "200"], capsys)
    assert (code, err) == (0, "")
    assert "2 micro-batches, checkpointing full (2 blocks)" in out, out


def test_pipeline_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--pipeline lays stages along an axis, --schedule and --micro-batches pin what they name,
    the planner picks the rest; --virtual-stages out of the schedule's range is refused."""
    body = """
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def stack():
        return Stack(), (torch.randn(8, 8),), loss
    """
    path = f"{builder(tmp_path, body)}:stack"
    args = ["plan", path, "--mesh", "pp=2,dp=2", "--hardware", "cpu", "--width", "200", "--pipeline", "pp"]
    code, out, err = run([*args, "--schedule", "1f1b", "--micro-batches", "4"], capsys)
    assert (code, err) == (0, "")
    assert "pp=2 x stage mesh dp=2: 1f1b, 2 x 1 stages, 4 micro-batches" in out, out
    code, out, err = run([*args, "--schedule", "zbv", "--virtual-stages", "1"], capsys)
    assert code == 2 and "virtual_stages = 2" in err, err
    code, out, err = run([*args[:-2], "--schedule", "1f1b"], capsys)  # not planned without a pipeline
    assert code == 2 and "add --pipeline AXIS" in err, err
    searched = ["plan", path, "--mesh", "dp=4", "--hardware", "cpu", "--width", "200", "--pipeline", "pp",
                "--pipeline-from", "dp", "--schedule", "gpipe"]  # the depth chosen, among 1, 2 and 4 pp ranks
    code, out, err = run(searched, capsys)
    assert (code, err) == (0, "")
    assert "pipeline depth search: 3 depths tried" in out, out
    default = ["plan", path, "--mesh", "dp=4", "--hardware", "cpu", "--width", "200"]  # the depth searched too
    code, out, err = run(default, capsys)
    assert (code, err) == (0, "") and "pipeline depth search: 3 depths tried" in out, out
    code, out, err = run([*default, "--no-pipeline"], capsys)
    assert (code, err) == (0, "") and "pipeline depth search" not in out, out
    code, out, err = run([*default, "--no-pipeline", "--pipeline", "pp"], capsys)
    assert code == 2 and "pass one" in err, err
    code, out, err = run(["plan", path, "--mesh", "4", "--hardware", "cpu", "--width", "200"], capsys)  # axes open
    assert (code, err) == (0, "") and "mesh layout search: 2 layouts of 4 devices tried" in out, out


def test_gathering_again_per_block_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--regather-blocks`` reaches the memory pins: with ``--zero dp=3`` it plans, without
    ZeRO-3 it is refused (what it does: ``test_overlap``, ``test_numerics_zero``); the model has
    repeated blocks, as the option needs."""
    body = """
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def stack():
        return Stack(), (torch.randn(4, 8),), loss
    """
    args = ["plan", f"{builder(tmp_path, body)}:stack", "--mesh", "dp=2", "--hardware", "cpu", "--width", "200",
            "--regather-blocks", "1"]
    code, out, err = run([*args, "--zero", "dp=3"], capsys)
    assert (code, err) == (0, ""), err
    assert "ZeRO-3 on dp" in out, out
    code, out, err = run(args, capsys)
    assert code != 0 and "regather_blocks=1 needs ZeRO-3 pinned" in err, err


def test_zero1_is_pinned_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--zero dp=1`` plans ZeRO-1 on dp (the table's memory line says so); with --offload it is refused."""
    args = ["plan", f"{builder(tmp_path, '')}:build", "--mesh", "dp=2", "--hardware", "cpu", "--width", "200"]
    code, out, err = run([*args, "--zero", "dp=1", "--json", str(tmp_path / "plan.json")], capsys)
    assert (code, err) == (0, "")
    assert "ZeRO-1 on dp" in out
    memory = json.loads((tmp_path / "plan.json").read_text())["memory"]
    assert memory["zero"] == {"dp": 1} and set(memory["zero1"].values()) == {"dp"}
    code, out, err = run([*args, "--zero", "dp=1", "--offload"], capsys)
    assert code == 2 and "not both" in err, err


def test_expert_parallelism_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``--data-axes`` and ``--expert-axes`` reach the pins (the table's pinned line names the expert
    weights left free); an expert axis outside the data axes is refused (exit 2)."""
    args = ["plan", f"{Path(moe.__file__)}:build", "--hardware", "cpu", "--width", "200"]
    code, out, err = run([*args, "--mesh", "ep=2", "--data-axes", "ep", "--expert-axes", "ep", "--no-pipeline"],
                         capsys)
    assert (code, err) == (0, ""), err
    assert "ep: parameters, inputs: data parallel, 6 expert weights free" in out, out
    code, out, err = run([*args, "--mesh", "dp=2,ep=2", "--data-axes", "dp", "--expert-axes", "ep",
                          "--no-pipeline"], capsys)
    assert code == 2 and "expert_axes ('ep',) names 'ep', not in data_axes ('dp',)" in err, err
    code, out, err = run([*args, "--mesh", "ep=2", "--data-axes", "ep", "--expert-axes", "ep",
                          "--moe-imbalance", "1.2"], capsys)
    assert (code, err) == (0, ""), err
    code, out, err = run([*args, "--mesh", "ep=2", "--moe-imbalance", "0.9"], capsys)
    assert code == 2 and "must be at least 1" in err, err


def test_a_builder_may_return_a_dict_with_example_kwargs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dict names what a tuple cannot pass (``example_kwargs``); an unknown key is refused by name."""
    body = """
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, *, scale):
            return self.lin(x) * scale

    def as_dict():
        return {"model": Scaled(), "example_inputs": (torch.randn(4, 8),), "example_kwargs": {"scale": 2.0},
                "loss_fn": loss}

    def typo():
        return {"model": Scaled(), "example_inputs": (torch.randn(4, 8),), "example_kwarg": {"scale": 2.0}}
    """
    path = builder(tmp_path, body)
    code, out, err = run(["plan", f"{path}:as_dict", "--mesh", "dp=2", "--hardware", "cpu", "--width", "200"], capsys)
    assert (code, err) == (0, ""), err
    code, out, err = run(["plan", f"{path}:typo", "--mesh", "dp=2", "--hardware", "cpu"], capsys)
    assert code == 2 and "returned a dict with unknown keys ['example_kwarg']" in err, err


@pytest.mark.parametrize("name", ["rich", "copy"])
def test_a_builder_file_named_as_a_library_module_does_not_shadow_it(tmp_path: Path, name: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", f"{builder(tmp_path, '', name=name)}:build", "--mesh", "dp=2", "--hardware", "cpu",
                          "--width", "200"], capsys)
    assert (code, err) == (0, ""), err
    assert "limit" in out


def test_exit_codes_follow_the_convention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each was 0 or 1: a superscript digit (int() refused it after isdigit() took it), an unwritable
    --json (after printing the plan), a builder calling sys.exit(0), --width 0 (printed nothing)."""
    path = builder(tmp_path, "def leaves():\n    import sys\n    sys.exit(0)\n")
    args = ["--hardware", "cpu", "--width", "200"]
    code, out, err = run(["plan", f"{path}:build", "--mesh", "dp=\u00b2", *args], capsys)
    assert code == 2 and "bad mesh spec" in err, err
    code, out, err = run(["plan", f"{path}:build", "--mesh", "dp=2", *args, "--json", str(tmp_path / "no" / "p.json")],
                         capsys)
    assert (code, out) == (2, "") and "--json" in err and "cannot write there" in err, err
    code, out, err = run(["plan", f"{path}:leaves", "--mesh", "dp=2", *args], capsys)
    assert (code, out) == (2, "") and "exited (sys.exit(0)) instead of returning" in err, err
    code, out, err = run(["plan", f"{path}:build", "--mesh", "dp=2", "--hardware", "cpu", "--width", "0"], capsys)
    assert (code, out) == (2, "") and "must be positive" in err, err
