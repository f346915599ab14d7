"""cluster: the Ray Serve application (ingress, adapter-affinity router, adapter tier).

Not built yet: this package lands with the issue "cluster: the Ray Serve
application". It is the only package that imports ray.
"""
