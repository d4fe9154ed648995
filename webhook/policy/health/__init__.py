"""Device health verdicts (pure): the controllers' and the node agent's decisions about devices.

Re-exported here so that `webhook.policy.health` keeps working while `ladder` is cut at its seams."""

from webhook.policy.health.fences import *  # noqa: F403
from webhook.policy.health.ladder import *  # noqa: F403
from webhook.policy.health.observed import *  # noqa: F403
from webhook.policy.health.podverdicts import *  # noqa: F403
from webhook.policy.health.records import *  # noqa: F403
from webhook.policy.health.signals import *  # noqa: F403
