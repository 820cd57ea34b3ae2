"""The ``functional_load`` load format in real vLLM with the weights in S3 (run with the vLLM
environment's python; ``harness.plugin_record`` starts the S3 server and calls it).

vLLM 0.32 refuses an object-storage model for every load format but its own streamers ("To load a
model from object storage (S3/GCS/Azure), 'load_format' must be 'modelexpress', 'runai_streamer' or
'runai_streamer_sharded'"), so the model is a local directory with the config files and the weights
are named in ``model_loader_extra_config={"weights": "s3://bucket/prefix"}``:

    python -m harness.plugin_s3 CONFIG_DIR s3://bucket/prefix OUT.json --report-dir DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.vllm_generate import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config_dir")
    parser.add_argument("weights")
    parser.add_argument("out", type=Path)
    parser.add_argument("--report-dir", default=None)
    args = parser.parse_args()
    extra = {"weights": args.weights, **({"report_dir": args.report_dir} if args.report_dir else {})}
    args.out.write_text(json.dumps({"functional_load": run(args.config_dir, "functional_load", extra, 1, 1, 1, False)}, indent=1))


if __name__ == "__main__":
    main()
