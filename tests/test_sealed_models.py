"""A model folder's SHA256SUMS vouches for its weights only if it lists them and names nothing outside the
folder: a damaged model whose SHA256SUMS was edited is refused by name, for a run here and for a dry run."""

import hashlib
import shutil

import pytest

from kvrl.config import load_config
from kvrl.models import SHIPPED
from kvrl.preflight.machine import run_problems
from kvrl.run import main
from kvrl.runlog import SUMS, damage


def damaged_copy(tmp_path, sums: str):
    """A copy of the shipped tiny reasoner with a flipped weight byte, its SHA256SUMS edited as `sums` says:
    `dropped` (the weights' line removed) or `outside` (the line names an intact copy outside the folder)."""
    intact = tmp_path / "intact"
    shutil.copytree(SHIPPED["tiny"][0], intact)
    folder = tmp_path / "deep" / "er" / "model"
    shutil.copytree(intact, folder)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-3] ^= 0x40
    (folder / "model.safetensors").write_bytes(bytes(data))
    lines = [line for line in (folder / SUMS).read_text().splitlines() if not line.endswith("model.safetensors")]
    if sums == "outside":
        digest = hashlib.sha256((intact / "model.safetensors").read_bytes()).hexdigest()
        lines.append(f"{digest}  ../../../intact/model.safetensors")
    (folder / SUMS).write_text("".join(f"{line}\n" for line in lines))
    return folder


@pytest.mark.parametrize("sums", ["dropped", "outside"])
def test_a_sums_file_that_does_not_cover_the_weights_is_damage(tmp_path, sums):
    """Before: both folders passed (None), and the flipped weights loaded with exit status 0."""
    folder = damaged_copy(tmp_path, sums)
    why = {
        "dropped": f"{folder / 'model.safetensors'} is not listed in {folder / SUMS}, which must list every "
        "weight file below its folder",
        "outside": f"{folder / SUMS} names '../../../intact/model.safetensors', a file outside {folder}; a "
        f"{SUMS} lists only files inside its folder",
    }
    assert damage(folder) == why[sums]


@pytest.mark.parametrize("sums", ["dropped", "outside"])
def test_a_damaged_model_is_refused_by_the_gate(tmp_path, sums):
    folder = damaged_copy(tmp_path, sums)
    cfg = load_config(["recipe=tiny_eval", f"model.path={folder}", f"output_dir={tmp_path / 'run'}"])
    [problem] = run_problems(cfg)
    assert problem.startswith(f"model.path={folder} is damaged: ") and "seal(" in problem, problem


@pytest.mark.parametrize("sums", ["dropped", "outside", "intact_listing"])
def test_a_dry_run_of_a_damaged_model_exits_2_by_name(tmp_path, capsys, sums):
    """Before: `dropped` and `outside` planned with exit status 0; a damaged folder whose SHA256SUMS still
    listed the weights (`intact_listing`) was a ValueError traceback."""
    folder = damaged_copy(tmp_path, "dropped" if sums == "intact_listing" else sums)
    if sums == "intact_listing":
        shutil.copy(SHIPPED["tiny"][0] / SUMS, folder / SUMS)
    assert main(["recipe=tiny_eval", f"model.path={folder}", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvrl: error: model.path={folder} is damaged: "), err
    assert "Traceback" not in err and "sealed anew" in err, err
