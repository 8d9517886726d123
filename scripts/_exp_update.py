import tempfile, time, sys, statistics
from pathlib import Path
import torch
torch.set_num_threads(1)
from benchmarks.common import REPO_ROOT
from benchmarks.orchestration import warm_policy
from trace.configuration.params_file import load_config
from trace.envs.registry import make_environment
from trace.predictor import make_predictor
from trace.training.loop import Trainer
import trace.update.updater as U
from trace.update.batch import build_training_batch
base = load_config(Path("params.yaml"))
env = make_environment(base.task, base.seed, root=REPO_ROOT)
policy, info = warm_policy(base, env, 80, 16, 0.003, cache=True)
tr = Trainer(base, "trace", policy=policy, env=env, train_prompts=env.prompts("train"),
             eval_prompts=env.prompts("eval"), predictor=make_predictor(base.predictor, env=env, policy=policy, seed=0),
             run_dir=Path(tempfile.mkdtemp()), progress=False)
captured = {}
orig = U.PolicyUpdater.rl_step if hasattr(U, "PolicyUpdater") else None
cls = [c for c in vars(U).values() if isinstance(c, type) and hasattr(c, "rl_step")][0]
orig = cls.rl_step
def cap(self, trees, temperature=1.0):
    captured["trees"] = trees; captured["self"] = self
    return orig(self, trees, temperature)
cls.rl_step = cap
tr.step(0)
upd, trees = captured["self"], captured["trees"]
b = build_training_batch(trees, upd.pad_token_id, upd.max_tokens)
L = b.lengths.tolist()
print("rows", len(L), "max", max(L), "mean", statistics.mean(L), "padded tokens/real", sum(max(L[i:i+64])*len(L[i:i+64]) for i in range(0,len(L),64))/sum(L))
Ls = sorted(L); print("sorted padded/real", sum(max(Ls[i:i+64])*len(Ls[i:i+64]) for i in range(0,len(Ls),64))/sum(Ls))
model = upd.engine.module
def timeit(label, n=3):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); orig(upd, trees, 1.0); ts.append(time.perf_counter()-t)
    print(label, [round(x,3) for x in ts], "median", round(statistics.median(ts),3))
for rep in range(2):
    model.config._attn_implementation = "eager"; timeit("eager")
    model.config._attn_implementation = "sdpa"; timeit("sdpa")
