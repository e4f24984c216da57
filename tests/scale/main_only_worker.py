"""One rank of `train.distributed.run_on_main_process` (gloo; RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set as torchrun sets them), for the quick tests:

    tests/scale/main_only_worker.py OUT_DIR

Two stages in turn: `ok` (rank 0 writes OUT_DIR/ok-ran-by-rank0 and returns {"value": 42}) and
`fail` (rank 0 raises); every rank writes what it got from each to OUT_DIR/<stage>-rank<r>.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    from train.distributed import MainProcessFailed, run_on_main_process

    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    for mode in ("ok", "fail"):
        def work(mode=mode) -> dict:
            (out / f"{mode}-ran-by-rank{rank}").write_text("")
            if mode == "fail":
                raise ValueError("bad head")
            return {"value": 42}

        try:
            got = {"result": run_on_main_process(work, "test stage")}
        except MainProcessFailed as error:
            got = {"failed": str(error)}
        except ValueError as error:
            got = {"raised": str(error)}
        (out / f"{mode}-rank{rank}.json").write_text(json.dumps(got))

if __name__ == "__main__":
    main()
