"""Discovery sources: where groups of ranks come from (``router.control.topology.DiscoverySource``).

* ``static.StaticDiscovery``: the endpoints of the configuration file, published once.
* ``kubernetes.KubernetesDiscovery``: lists and watches an InferencePool (or a plain label
  selector) and its Pods.

Nothing is imported here, so a deployment without Kubernetes never loads ``kubernetes_asyncio``.
"""
