"""Services: the business rules. Every door (CLI, jobs, HTTP) calls these and nothing else."""
