"""Checkpoint folders shaped like megatron dist checkpoints, for tests of what is on disk."""

from checkpointing import state as checkpoint


def fake_checkpoint(ckpt_dir, step, files=None):
    """A folder shaped like a dist checkpoint, with its manifest, and ``latest`` pointing at it."""
    folder = ckpt_dir / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    for name, text in (files or {"metadata.json": "{}", ".metadata": "x" * 50,
                                 "__0_0.distcp": "y" * 1000}).items():
        (folder / name).write_text(text)
    checkpoint.write_manifest(str(folder))
    (ckpt_dir / "latest").write_text(folder.name)
    return folder
