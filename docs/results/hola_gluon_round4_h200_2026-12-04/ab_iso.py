# A/B of Gluon kernel variants, each in its own process with its own timeout (a variant that hangs, e.g. on an
# mbarrier phase, costs only its own slot). Each child times the tree's kernels ("new") and the variant in one process
# and checks the variant's outputs against the tree's (rel. diffs). usage: ab_iso.py OUT.json TIMEOUT_S variant.py ...
import json, os, subprocess, sys, tempfile
HERE = os.path.dirname(os.path.abspath(__file__))
out, limit, variants = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
res = {}
for v in variants:
    name = v.rsplit("/", 1)[-1][:-3]
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, "ab.py"), os.path.join(tempfile.gettempdir(), f"ab_{name}.json"), v], capture_output=True, text=True,
                           timeout=limit)
        lines = [l for l in p.stdout.splitlines() if "rel. diff" in l or l.startswith((name, "new"))]  # ragged checks included
        print(f"== {name}: rc {p.returncode}", *lines, p.stderr[-1500:] if p.returncode else "", sep="\n", flush=True)
        res[name] = json.load(open(os.path.join(tempfile.gettempdir(), f"ab_{name}.json"))) if p.returncode == 0 else {"rc": p.returncode}
    except subprocess.TimeoutExpired as e:
        print(f"== {name}: TIMEOUT after {limit} s (hang?)", (e.stdout or b"")[-2000:], flush=True)
        res[name] = {"timeout": limit}
json.dump(res, open(out, "w"), indent=1)
