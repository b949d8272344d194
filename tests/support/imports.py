"""What importing a module brings in, read from a fresh interpreter (the test process has imported
everything already)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from controller_runtime.toolchain import REPO_ROOT


def imported_packages(module: str, packages: Sequence[str]) -> list[str]:
    """The modules of `packages` (each a package or module name) that `import module` loads."""
    wanted = tuple(packages)
    script = (
        f"import sys, {module}\n"
        f"print(' '.join(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in {wanted!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.split()
