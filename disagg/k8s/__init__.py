"""Kubernetes manifests for a spec with pools: one StatefulSet per pool, a front Deployment, and what
keeps them reachable only where they must be (manifests), checked for the security basics (lint)."""
