"""`build-engines`: what is built for each role, and the manifest that makes rebuilding incremental."""
