"""What the ``python -c`` child processes of the tests share."""
from __future__ import annotations

#: The first line of a child's code: its exit skips the interpreter's last garbage collection over the heap that
#: torch, timm and Lightning leave (2-3 s of a 2-core CPU per child), as vispe's own entry points do
#: (:func:`vispe.cli.exit_without_final_collection`).
FAST_EXIT = "import atexit, gc; atexit.register(gc.freeze)\n"
