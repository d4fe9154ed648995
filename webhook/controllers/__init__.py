"""Controllers that respond to device failures (node health, pod device health): level-triggered
reconcilers over `webhook.kube` informers, deciding through the pure verdicts of `webhook.policy`."""
