"""Device health verdicts (pure): the controllers' and the node agent's decisions about devices.

For now the whole of it is `ladder`, re-exported here so that `webhook.policy.health` keeps working
while the module is cut at its seams."""

from webhook.policy.health.ladder import *  # noqa: F403
