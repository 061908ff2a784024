"""Compile the fused kernels of several source trees side by side (a developer probe for register/spill A/Bs):

    python dev/regs_variants.py --world 2 TREE [TREE ...]     # each TREE holds a kosmos/ package

Each tree is compiled in its own subprocess (its own ``kosmos`` import), through dev/kernel_resources.py."""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--world", default="2")
    ap.add_argument("--kernels", default="all_gather_matmul,matmul_reduce_scatter,moe_forward")
    args = ap.parse_args(argv)
    code = ("import sys, importlib.util; sys.path.insert(0, sys.argv[1]); "
            "spec = importlib.util.spec_from_file_location('kr', sys.argv[2]); m = importlib.util.module_from_spec(spec); "
            "spec.loader.exec_module(m); sys.exit(m.main(['--world', sys.argv[3], '--kernels', sys.argv[4]]))")
    procs = {t: subprocess.Popen([sys.executable, "-c", code, t, os.path.join(HERE, "kernel_resources.py"), args.world,
                                  args.kernels],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for t in args.trees}
    for t, p in procs.items():
        out = p.communicate()[0]
        for line in out.splitlines():
            if line.startswith(("all_", "matmul", "w1_", "moe", "triton", "Traceback", "Error")) or "Error" in line:
                print(f"{os.path.basename(t.rstrip('/')):<6} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
