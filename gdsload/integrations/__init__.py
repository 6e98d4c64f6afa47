"""Glue for trainers that need some, imported only by the code that uses it (never by
`import gdsload`; each module imports its trainer's library on first use, with an install hint).

- Lightning (`Trainer.fit`) and HF accelerate (`prepare`, `register_for_checkpointing`,
  `save_state`/`load_state`) need none: they save and load `loader.state_dict()` themselves
  (`examples/lightning_resume.py`, `examples/accelerate_resume.py`).
- The HF `transformers.Trainer` saves no loader state and resumes by skipping batches:
  `gdsload.integrations.hf` (`examples/hf_trainer_resume.py`).
"""
