import cProfile, pstats, tempfile, time, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from benchmarks.common import REPO_ROOT
from benchmarks.orchestration import warm_policy
from trace.configuration.params_file import load_config
from trace.envs.registry import make_environment
from trace.policy.model import load_policy, save_policy
from trace.predictor import make_predictor
from trace.training.loop import Trainer
base = load_config(Path("params.yaml"))
env = make_environment(base.task, base.seed, root=REPO_ROOT)
policy, info = warm_policy(base, env, 80, 16, 0.003, cache=True)
work = Path(tempfile.mkdtemp())
tr = Trainer(base, sys.argv[1] if len(sys.argv)>1 else "trace", policy=policy, env=env, train_prompts=env.prompts("train"),
             eval_prompts=env.prompts("eval"), predictor=make_predictor(base.predictor, env=env, policy=policy, seed=0),
             run_dir=work, progress=False)
tr.step(0)
t=time.perf_counter(); m=tr.step(1); print("step1", time.perf_counter()-t, {k:round(float(v),3) for k,v in m.items() if k.startswith("time/")})
pr = cProfile.Profile(); pr.enable()
m=tr.step(2)
pr.disable()
print({k:round(float(v),3) for k,v in m.items() if k.startswith("time/")})
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
