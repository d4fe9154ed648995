"""Everything that talks to the Kubernetes API, and the only code that imports the `kubernetes` client:
the client and list/watch access (`client`), the informer cache (`informer`), the cluster facts
admission reads (`facts`), the policy ConfigMap (`policy_source`), Events (`events`) and the
certificates' Secret and caBundles (`certificates`)."""
