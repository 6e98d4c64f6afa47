"""Preprocessing passes: every video (or recording) of a dataset once, in stored order, through a
user `fn`, its outputs written as a new dataset, exactly once across crashes (`gdsload.process`,
which is `gdsload.preprocess.run.process`).

Modules: `options` (the checked options, `fn` by name), `media` (streaming decode of one member
into frame or speech windows: `gdsload.decode.passmedia`, re-exported; the feed's server runs it
too when a pass decodes there, `feed=`), `unit` (one input shard's windows into its output shards, crash
records), `run` (the driver: DST, resume record, units here / in workers / on Ray, manifest),
`ray_engine` (units as Ray tasks).
"""
