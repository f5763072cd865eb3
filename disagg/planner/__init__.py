"""How many prefill and decode instances: step times profiled on the deployment's own engines, a
simulation of each split under a workload, and the split with the most goodput per instance."""
