"""What the int8 products' per-block float epilogue costs beside their VPDPBUSDs.

bench/native/int8_loop.c copies the pass the int8 products run over a pair of weight groups'
panels (worker/baton/engine/native/quant_int8.h) and times it with the epilogue whole, with
parts of it left out, and with none: each block of 32 inputs takes 8 VPDPBUSDs a row and
group, then a conversion, d_w * d_x and two FMAs. Timing only (the partial variants compute
nothing useful). Needs a CPU with AVX512-VNNI; one thread.

    python bench/int8_loop.py            # writes bench/results/int8_loop.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from machine_info import machine_record

from baton.engine.cpu_features import this_cpu
from baton.engine.native.build import FLAGS

HERE = Path(__file__).parent
SOURCE = HERE / "native" / "int8_loop.c"
SHARED_ONLY = {"-shared", "-fPIC", "-fopenmp"}  # the library's, not a program's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=1536, help="inputs (SmolLM2's down projection: 1,536)")
    parser.add_argument("--groups", type=int, default=36, help="groups of 16 outputs (576 outputs)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "int8_loop.json")
    args = parser.parse_args()
    if "avx512_vnni" not in this_cpu().flags:
        parser.error("this CPU has no AVX512-VNNI: the int8 products do not run here")
    flags = [f for f in FLAGS if f not in SHARED_ONLY]
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "int8_loop"
        subprocess.run(["cc", *flags, str(SOURCE), "-o", str(program)], check=True)
        done = subprocess.run([str(program), str(args.k), str(args.groups), str(args.rows), str(args.rounds)],
                              check=True, capture_output=True, text=True, timeout=600)
    variants = {}
    for line in done.stdout.splitlines():
        name, ms, gmacs = line.split("\t")
        variants[name] = {"ms": float(ms), "gmac_per_s": float(gmacs)}
    bound = variants["no epilogue"]["gmac_per_s"]
    for row in variants.values():
        row["share_of_no_epilogue"] = round(row["gmac_per_s"] / bound, 3)
    report = {"bench": "int8_loop", "machine": machine_record(1), "compiler_flags": flags,
              "shape": {"k": args.k, "outputs": 16 * args.groups, "rows": args.rows}, "rounds": args.rounds,
              "variants": variants}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, row in variants.items():
        print(f"{name:32s} {row['ms']:8.3f} ms  {row['gmac_per_s']:7.1f} GMAC/s  {row['share_of_no_epilogue']:.2f}")


if __name__ == "__main__":
    main()
