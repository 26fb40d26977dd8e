"""Infrastructure every stage leans on: the content-addressed cache, cross-node locks, the job's
log and progress display, device names, and the number of CPU threads a job uses."""
