"""Print a compact per-shape table of a results file (for narrow terminals and device logs):
``python -m dev.summary FILE``."""
import sys

from kosmos_bench.report import build_table, geomean_table, load_results


def main(path: str) -> None:
    df = build_table(load_results([path])[1])
    for _, r in df.iterrows():
        t = f"{r['time_ms']:.3f}" if r["time_ms"] == r["time_ms"] and r["time_ms"] is not None else "-"
        sp = f"{r['speedup']:.2f}" if r["speedup"] == r["speedup"] else "-"
        print(f"{r['model']:>11} {r['layer']:>8} {int(r['seq']):>6} {r['impl']:>16} {r['status']:>7} {t:>8} {sp:>5}"
              f" {'' if r['status'] == 'ok' else str(r['reason'])[:60]}")
    print(geomean_table(df).to_string())


if __name__ == "__main__":
    main(sys.argv[1])
