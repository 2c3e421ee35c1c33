"""What the tests share: launching runs (:mod:`.launch`), launchers that observe a run from
outside (:mod:`.topk_digest`, :mod:`.nan_injection`, ...), the one parity harness
(:mod:`.parity`), and builders of small data, HF folders and checkpoints. Test modules import
from here, never from each other."""
