"""One run's results: the comparison behind its verdicts (:mod:`.summary`), the report and table
(:mod:`.report`, :mod:`.formatting`), long generations (:mod:`.longgen`), and MLflow
(:mod:`.tracking`, :mod:`.sync`)."""
