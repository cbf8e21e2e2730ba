"""A training run: from a config to a trained, checkpointed and measured model.

* `experiment`: a run end to end (`run_experiment`): corpus, runtime, run directory, then loop and finish;
* `runtime`: devices, XLA flags and kernels, resolved once before JAX starts, with reasons;
  `collective_watch`: one error line before XLA's collective timeout would abort a run on host devices;
  `distributed`: one run over several processes;
* `steps`: the jitted programs (init, optimizer steps, evaluation); `optim`, `adam8bit`: the optimizers;
* `loop`: a run's steps, evaluations and checkpoints; `resume`: where a stopped run goes on;
  `finish`: its sample, loss plot and result.json;
* `rundir`: the run directory; `metrics`: what a run records; `plots`: the pictures programs draw;
* `host_memory`, `crash_points`: host memory given back, and fault injection for the tests.
"""
