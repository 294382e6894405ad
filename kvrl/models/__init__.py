"""The tiny reasoners: builder, shipped weights, the small random models of the tests.

:data:`SHIPPED` names the weights shipped in ``kvrl/models/weights`` by their ``model.path``
name, with the recipe that trains each (importing this package loads no model code).
:func:`seal_problem` says why a sealed model folder must not load.
"""

from pathlib import Path

from kvrl.runlog import SUMS, damage

WEIGHTS = Path(__file__).parent / "weights"
SHIPPED = {
    "tiny": (WEIGHTS / "tiny_reasoner", "tiny_pretrain"),
    "tiny-multihop": (WEIGHTS / "tiny_multihop", "tiny_multihop_pretrain"),
}


def seal_problem(path: str) -> str | None:
    """Why model.path must not load, or None: a shipped model, or a folder sealed by a SHA256SUMS (a run's
    model/ or checkpoints/step_N/model/, a copy of a shipped model), whose files do not match it (one flipped
    byte of the weights loads silently and scores 0 everywhere). Reads every listed file; a folder without a
    SHA256SUMS (save_pretrained's, a hub download) has nothing to check against."""
    if path in SHIPPED:
        folder, recipe = SHIPPED[path]
        why = damage(folder)
        return (
            None
            if why is None
            else (
                f"the shipped {path} reasoner is damaged: {why}; restore it: reinstall kvrl (`pip install "
                f"--force-reinstall --no-deps kvrl`), or `git checkout -- {folder}` in a clone, or retrain it with "
                f"`python -m kvrl.run recipe={recipe}` and copy its output_dir/model over {folder}"
            )
        )
    folder = Path(path).expanduser()
    if not ((folder / "config.json").is_file() and (folder / SUMS).is_file()):
        return None
    why = damage(folder)
    return (
        None
        if why is None
        else (
            f"model.path={path} is damaged: {why}; copy the folder again from where it came (a run's model/, a "
            f"checkpoint's), or point model.path at an intact one; a folder changed on purpose is sealed anew with "
            f"python -c \"from kvrl.runlog import seal; seal('{folder}')\""
        )
    )
