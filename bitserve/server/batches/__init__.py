"""The Batch API (OpenAI's /v1/files and /v1/batches): input files, jobs and their requests kept in
SQLite or PostgreSQL, and a worker that runs them at low priority through the serving handlers, in process."""
