"""Stage: training (Ray Train + DeepSpeed + PEFT). ``trainer.train`` assembles the run; the worker's
algorithm is ``loop.WorkerRecipe``."""
