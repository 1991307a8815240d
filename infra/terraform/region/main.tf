# One rollout region: the replica of the weights bucket its workers read, and a spot GPU node
# group for the fleet in infra/regions/overlays/<region_name>. Apply this root first, then add
# the replica_bucket_arn output to the central root's `replicas`.

module "replica" {
  source                  = "../modules/weights_bucket"
  bucket                  = var.replica_bucket
  weights_prefix          = var.weights_prefix
  noncurrent_version_days = var.noncurrent_version_days
}

# What a worker needs on the replica: read the weights (LATEST, manifests, chunks). Attach it to
# the role the worker pods assume (EKS Pod Identity or IRSA); then the Secret needs no AWS keys.
data "aws_iam_policy_document" "worker_read" {
  statement {
    actions   = ["s3:ListBucket"]
    resources = [module.replica.arn]
  }
  statement {
    actions   = ["s3:GetObject"]
    resources = ["${module.replica.arn}/${var.weights_prefix}*"]
  }
}

resource "aws_iam_policy" "worker_read" {
  name   = "rlbus-worker-read-${var.region_name}"
  policy = data.aws_iam_policy_document.worker_read.json
}

# Spot GPU nodes, labelled and tainted so that only the rollout fleet lands on them (the
# Deployment's node affinity and toleration name rlbus.dev/preemptible).
resource "aws_eks_node_group" "rollout" {
  cluster_name    = var.cluster_name
  node_group_name = "rlbus-rollout-${var.region_name}"
  node_role_arn   = var.node_role_arn
  subnet_ids      = var.subnet_ids
  capacity_type   = "SPOT"
  instance_types  = var.instance_types
  ami_type        = var.ami_type
  disk_size       = var.node_disk_gib

  scaling_config {
    min_size     = var.min_nodes
    desired_size = var.min_nodes
    max_size     = var.max_nodes
  }

  update_config {
    max_unavailable_percentage = 33
  }

  labels = {
    "rlbus.dev/preemptible" = "true"
    "rlbus.dev/region"      = var.region_name
  }

  taint {
    key    = "rlbus.dev/preemptible"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  lifecycle {
    # The cluster autoscaler owns the current size.
    ignore_changes = [scaling_config[0].desired_size]
  }
}
