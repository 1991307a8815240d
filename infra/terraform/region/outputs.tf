output "replica_bucket_arn" {
  description = "Add to the central root's `replicas` under this region's name."
  value       = module.replica.arn
}

output "store_url" {
  description = "The workers' --store URL: `store` in the region's overlay."
  value       = module.replica.store_url
}

output "worker_read_policy_arn" {
  description = "IAM policy for the worker pods' role."
  value       = aws_iam_policy.worker_read.arn
}
