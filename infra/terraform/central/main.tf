# The central weights bucket and its replication into every regional bucket.
#
# S3 keeps one replication configuration per bucket, so the rules of all regions live here, one
# per entry of var.replicas; each region root (../region) creates its replica bucket first.

module "weights" {
  source                  = "../modules/weights_bucket"
  bucket                  = var.bucket
  weights_prefix          = var.weights_prefix
  noncurrent_version_days = var.noncurrent_version_days
}

data "aws_iam_policy_document" "replication_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["s3.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "replication" {
  name               = "rlbus-weights-replication"
  assume_role_policy = data.aws_iam_policy_document.replication_assume.json
}

data "aws_iam_policy_document" "replication" {
  statement {
    actions   = ["s3:GetReplicationConfiguration", "s3:ListBucket"]
    resources = [module.weights.arn]
  }
  statement {
    actions = [
      "s3:GetObjectVersionForReplication",
      "s3:GetObjectVersionAcl",
      "s3:GetObjectVersionTagging",
    ]
    resources = ["${module.weights.arn}/*"]
  }
  dynamic "statement" {
    for_each = length(var.replicas) > 0 ? [1] : []
    content {
      actions   = ["s3:ReplicateObject", "s3:ReplicateDelete", "s3:ReplicateTags"]
      resources = [for replica in values(var.replicas) : "${replica.bucket_arn}/*"]
    }
  }
}

resource "aws_iam_role_policy" "replication" {
  name   = "replicate-weights"
  role   = aws_iam_role.replication.id
  policy = data.aws_iam_policy_document.replication.json
}

resource "aws_s3_bucket_replication_configuration" "weights" {
  count  = length(var.replicas) > 0 ? 1 : 0
  bucket = module.weights.id
  role   = aws_iam_role.replication.arn

  dynamic "rule" {
    for_each = var.replicas
    content {
      id       = "weights-to-${rule.key}"
      priority = index(sort(keys(var.replicas)), rule.key)
      status   = "Enabled"
      filter {
        prefix = var.weights_prefix
      }
      # Retention deletes (delete markers) reach the regional copies too.
      delete_marker_replication {
        status = "Enabled"
      }
      destination {
        bucket        = rule.value.bucket_arn
        storage_class = "STANDARD"
      }
    }
  }

  depends_on = [module.weights] # replication needs versioning on the source
}
