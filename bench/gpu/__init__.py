"""The GPU kit (docs/gpu.md): `prepare.sh` packs what a bare GPU machine lacks, `run.sh` measures there."""
