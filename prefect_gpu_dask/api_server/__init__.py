"""What runs in Prefect's API server process, which loads it as a Prefect collection."""
