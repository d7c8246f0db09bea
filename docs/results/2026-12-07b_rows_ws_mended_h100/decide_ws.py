# Decision written before the data: per quant, the rows walk (ws) replaces the grid launch where its
# producer/whole median is lower than grid's in at least 6 of the 8 cells, the median over cells of
# ws/grid is below 0.97, and its arm checked clean (bad == 0) in every cell.
import json, re, statistics, sys
d = json.load(open(sys.argv[1]))
flip = {}
for q in ("ptpc", "blockscale"):
    cells = [r for r in d["runs"] if r["quant"] == q and r["pattern"] == "rs-rows"]
    if not cells:
        continue
    ws = [r["ratios"]["rs-rows kernel-ws"]["median"] for r in cells]
    gr = [r["ratios"]["rs-rows kernel-grid"]["median"] for r in cells]
    bad = sum(r["bad"].get("rs-rows kernel-ws", 1) for r in cells)
    wins = sum(w < g for w, g in zip(ws, gr))
    rel = statistics.median(w / g for w, g in zip(ws, gr))
    ok = wins >= 6 and rel < 0.97 and bad == 0 and len(cells) == 8
    print(f"{q}: cells {len(cells)} ws wins {wins} median ws/grid {rel:.3f} bad {bad} -> {'ws' if ok else 'grid'}")
    for r, w, g in zip(cells, ws, gr):
        print(f"  {r['shape']} M={r['m']} W={r['world']}: grid {g:.3f} ws {w:.3f} rule {r['ratio']['median']:.3f} producer {r['producer']}")
    if ok:
        flip[q] = "ws"
if "--apply" in sys.argv and flip:
    p = "cco/backends/cuda.py"
    src = open(p).read()
    line = re.search(r'^RS_ROWS_KERNEL_LAUNCH = \{.*\}$', src, re.M).group(0)
    new = line
    for q in flip:
        new = new.replace(f'"{q}": "grid"', f'"{q}": "ws"')
    open(p, "w").write(src.replace(line, new))
    print("applied:", new)
