"""The persistent_shapes() index with the least summed time over the forms it serves, from gemv_stack.json."""
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")
from tokenspeed.kernels.gemm.fp8_gemv_persistent_triton import persistent_shapes

forms = json.loads(Path(sys.argv[1]).read_text())["metrics"]["forms"]
totals = []
for i, c in enumerate(persistent_shapes()):
    ts = [r["fp8_us"].get(repr(c)) for r in forms.values() if repr(c) in r["fp8_us"]]
    if ts:
        totals.append((sum(ts), i))
totals.sort()
print(totals)
Path(sys.argv[2]).write_text(str(totals[0][1]))
Path(sys.argv[2] + ".second").write_text(str(totals[1][1] if len(totals) > 1 else totals[0][1]))
