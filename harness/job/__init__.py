"""One job, ``python -m harness``: the pipeline (:mod:`.pipeline`) and its stages, what makes a
job and its cached pieces the same (:mod:`.identity`), the reference (:mod:`.reference`,
:mod:`.background_reference`), the sweep a job belongs to (:mod:`.sweep`), and what each stage
used (:mod:`.stage_meter`) and will write (:mod:`.disk`)."""
