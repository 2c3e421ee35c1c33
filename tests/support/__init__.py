"""What the tests share: launching runs (:mod:`.launch`; training runs go to a :mod:`.rank_pool`,
one set of ranks per world size and CPU emulation that runs them one after another), launchers
that observe a run from outside (:mod:`.nan_injection`, ...) or record inside it
(:mod:`.topk_digest`), the one parity harness (:mod:`.parity`), and builders of small data, HF
folders and checkpoints. Test modules import from here, never from each other."""
