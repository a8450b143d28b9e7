"""The README's set-up promises: exactly two set-up commands (the code blocks that install), the main job's
installing the package alone before it serves (that serving needs nothing of the test extra: test_packaging.py
serves with the extra's packages hidden) and the tests' installing `.[test]`; `.ci/run` runs the tests' command step
by step."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup_commands() -> list[list[str]]:
    """The README's code blocks that install something, each as its steps (`a && b` → [a, b])."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", (REPO / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    return [block.strip().split(" && ") for block in blocks if "pip install" in block]


def test_two_set_up_commands_and_serving_installs_the_package_alone():
    [serving, testing] = setup_commands()
    [torch, *serving_steps] = serving
    assert torch.startswith("pip install torch==") and testing[0] == torch
    assert serving_steps == ["pip install -e .", "omni-tts serve"]
    assert testing[1:] == ['pip install -e ".[test]"', "python -m pytest -q -rs -n 2 --dist loadfile"]


def test_ci_runs_the_readmes_test_command():
    [_, testing] = setup_commands()
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python -m ")]
    quiet = [re.sub(r"^pip install ", "python -m pip install -q ", step) for step in testing]
    assert ci == quiet
