"""Running a module under `torchrun --standalone` from a test, as a user would on one node."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun(module: str, args: list[str], *, nproc: int = 2, timeout: float = 240):
    """`torchrun --standalone --nproc-per-node nproc -m module *args` in the repository root,
    without launcher variables inherited from the test's own environment."""
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    command = [launcher, "--standalone", "--nproc-per-node", str(nproc), "-m", module, *args]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )
