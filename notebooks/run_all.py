"""Execute the notebooks in place (outputs saved), at quick size unless --full.

    python notebooks/run_all.py [--full] [NAME ...]
"""
import os
import sys
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent


def main(argv):
    full = "--full" in argv
    names = [a for a in argv if not a.startswith("--")]
    os.environ["FASTANNEAL_NOTEBOOK_QUICK"] = "0" if full else "1"
    os.environ.setdefault("MPLBACKEND", "Agg")
    for path in sorted(HERE.glob("*.ipynb")):
        if names and not any(n in path.name for n in names):
            continue
        nb = nbformat.read(path, as_version=4)
        nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                                resources={"metadata": {"path": str(HERE)}}).execute()
        tmp = path.with_name(path.name + ".tmp")
        nbformat.write(nb, tmp)
        os.replace(tmp, path)
        print(f"executed {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
