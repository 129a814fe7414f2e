#!/usr/bin/python3
"""tools/plot on small inputs of each kind: it writes a PNG, recovers the alpha-beta cost
model exactly from times made with it, and refuses input of the wrong kind with a message.
Exits 77 (Meson's SKIP) without matplotlib. Usage: test_plot.py SOURCE_ROOT"""
import json
import os
import subprocess
import sys
import tempfile
from importlib.machinery import SourceFileLoader

try:
    import matplotlib  # noqa: F401
except ImportError:
    print("SKIP: matplotlib is not installed (apt-get install python3-matplotlib)")
    sys.exit(77)

plot_path = os.path.join(sys.argv[1], "tools", "plot")
plot = SourceFileLoader("plot", plot_path).load_module()

# The fit: times made exactly by alpha = 20 us, beta = 1 ns/byte come back as those numbers.
sizes = [4096 * 2**k for k in range(10)]
alpha, beta = plot.fit_alpha_beta(sizes, [20e-6 + 1e-9 * b for b in sizes])
assert abs(alpha - 20e-6) < 1e-12 and abs(beta - 1e-9) < 1e-18, (alpha, beta)


def run(*args):
    return subprocess.run([plot_path, *args], capture_output=True, text=True)


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


with tempfile.TemporaryDirectory() as folder:
    metrics = os.path.join(folder, "run.jsonl")
    with open(metrics, "w") as f:
        for step in (50, 100):
            f.write(json.dumps({"step": step, "epoch": 1, "loss": 1.0 / step, "lr": 0.05, "samples_per_s": 1e4,
                                "test_accuracy": None, "wall_s": step / 100}) + "\n")
        f.write(json.dumps({"step": 100, "epoch": 1, "loss": 0.01, "lr": 0.05, "samples_per_s": 1e4,
                            "test_accuracy": 0.8, "wall_s": 1.1}) + "\n")
    bench = os.path.join(folder, "gloo.csv")
    with open(bench, "w") as f:
        f.write("[1,0]<stdout>:backend,world_size,device,bytes,count,iters,time_us,algbw_gbps,busbw_gbps,algorithm\n")
        for algorithm in ("all_reduce", "ring_all_reduce"):
            for b in sizes:
                t = 20e-6 + 1e-9 * b
                f.write(f"[1,0]<stdout>:gloo,2,cpu,{b},{b // 4},10,{t * 1e6:.3f},{b / t / 1e9:.6f},{b / t / 1e9:.6f},"
                        f"{algorithm}\n")
    results = os.path.join(folder, "results.json")
    with open(results, "w") as f:
        json.dump({"date_utc": "2026-11-30T00:00:00+00:00", "commit": "abc1234", "rows": [
            {"benchmark": "MLP samples/s", "nanoddp": 5e4, "torch": 2e4, "ratio": 2.5, "target": ">= 1.5x",
             "pass": True},
            {"benchmark": "no torch side", "nanoddp": 1.0, "torch": None, "ratio": None}]}, f)

    # One series per algorithm: a --ring run does not merge into the all_reduce one.
    series = plot.allreduce_series([bench])
    assert sorted(series) == [("gloo", 2, "cpu", "all_reduce"), ("gloo", 2, "cpu", "ring_all_reduce")], sorted(series)
    assert all(len(points) == len(sizes) for points in series.values()), series

    for kind, source in (("metrics", metrics), ("allreduce", bench), ("results", results)):
        out = os.path.join(folder, kind + ".png")
        done = run(kind, source, "-o", out)
        assert done.returncode == 0, (kind, done.stderr)
        assert is_png(out) and os.path.getsize(out) > 5000, kind

    wrong = run("allreduce", metrics, "-o", os.path.join(folder, "x.png"))
    assert wrong.returncode != 0 and "not allreduce_bench --csv output" in wrong.stderr, wrong.stderr
    missing = run("metrics", os.path.join(folder, "none.jsonl"), "-o", os.path.join(folder, "x.png"))
    assert missing.returncode != 0 and "no such file" in missing.stderr, missing.stderr
    nowhere = run("metrics", metrics, "-o", os.path.join(folder, "missing", "x.png"))
    assert nowhere.returncode != 0 and "cannot write a PNG file there" in nowhere.stderr, nowhere.stderr
    assert "Traceback" not in nowhere.stderr, nowhere.stderr
    # Not a PNG name: refused before anything is written (matplotlib ended in a traceback).
    readme = os.path.join(folder, "README.md")
    with open(readme, "w") as f:
        f.write("# kept\n")
    not_png = run("metrics", metrics, "-o", readme)
    assert not_png.returncode != 0 and "give a file name ending in .png" in not_png.stderr, not_png.stderr
    with open(readme) as f:
        assert f.read() == "# kept\n"
    # A run stopped mid-write leaves a last line without its newline: the lines before it are
    # plotted, with a word. A bad line elsewhere is still refused.
    cut = os.path.join(folder, "cut.jsonl")
    with open(metrics) as f, open(cut, "w") as g:
        g.write(f.read() + '{"step": 150, "epoch": 1, "lo')
    done = run("metrics", cut, "-o", os.path.join(folder, "cut.png"))
    assert done.returncode == 0 and "cut.jsonl:4: the last line is cut off" in done.stderr, done.stderr
    with open(metrics) as f, open(cut, "w") as g:
        g.write('{"step": 1, "lo\n' + f.read())
    broken = run("metrics", cut, "-o", os.path.join(folder, "cut.png"))
    assert broken.returncode != 0 and "cut.jsonl:1: not a JSON line" in broken.stderr, broken.stderr
print("tools/plot draws all three kinds and fits alpha + beta * bytes exactly")
